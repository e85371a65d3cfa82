//! Reading a checkpoint directory: one walk of it ([`DirScan`]), which runtime wrote it,
//! what each file is, and where the data (as opposed to holes) of sparse files is.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use imgfmt::{Kind, Role};

/// A regular file of the source directory.
#[derive(Debug, Clone)]
pub struct SourceFile {
    /// Relative, `/`-separated.
    pub name: String,
    pub path: PathBuf,
    pub size: u64,
    pub mode: u32,
    pub role: Role,
}

/// One entry under a scanned directory (the directory itself included, named ""), with
/// the metadata any change to it moves: what a push's stamp records (spec/transfer.md
/// §2). A write to a file always sets its ctime, a replaced file has another inode, and
/// an entry added, removed or renamed moves its directory's times.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Entry {
    /// Relative path, `/`-separated ("" for the directory itself).
    pub name: String,
    /// st_mode: file type and permissions.
    pub mode: u32,
    pub size: u64,
    pub mtime_ns: i64,
    pub ctime_ns: i64,
    pub inode: u64,
    pub dev: u64,
}

impl Entry {
    fn of(name: String, md: &std::fs::Metadata) -> Entry {
        use std::os::unix::fs::MetadataExt;
        let ns = |s: i64, n: i64| s.saturating_mul(1_000_000_000).saturating_add(n);
        Entry {
            name,
            mode: md.mode(),
            size: md.size(),
            mtime_ns: ns(md.mtime(), md.mtime_nsec()),
            ctime_ns: ns(md.ctime(), md.ctime_nsec()),
            inode: md.ino(),
            dev: md.dev(),
        }
    }
}

/// Why a directory could not be scanned, or holds nothing to pack. The doc comment of
/// each variant is its message.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
#[non_exhaustive]
pub enum ScanError {
    /// {0}: not a directory
    NotADirectory(String),
    /// reading {dir}: {source}
    Read { dir: String, source: io::Error },
    /// {0}: nothing to pack: no regular file in it
    NoFiles(String),
}

/// A checkpoint directory as one walk found it: its regular files (what is packed), the
/// entries skipped, and every entry's metadata (what a push's stamp compares). Taken once
/// per command and handed to every step that needs the directory's listing (checks, the
/// closest image's search, the stamp, the packer): none of them lists it again.
///
/// Entries that are not regular files (sockets, symlinks, devices) are skipped and
/// reported, not silently dropped; symlinks are never followed.
#[derive(Debug)]
pub struct DirScan {
    /// The directory, as given.
    pub dir: PathBuf,
    /// Regular files, by name (bytewise).
    pub files: Vec<SourceFile>,
    /// Names of entries that are neither regular files nor directories.
    pub skipped: Vec<String>,
    /// Every entry, the directory itself first, by name.
    pub entries: Vec<Entry>,
    /// When the walk began (ns since the epoch).
    pub taken_ns: i64,
}

thread_local! {
    static WALKS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// How many directory walks ([`DirScan::take`]) this thread has made: lets a test check
/// that a command walks its directory once.
#[doc(hidden)]
pub fn walks_on_this_thread() -> u64 {
    WALKS.with(|w| w.get())
}

impl DirScan {
    /// Walk `dir` (recursively; names sorted bytewise). Names must be UTF-8.
    pub fn take(dir: &Path) -> Result<DirScan, ScanError> {
        WALKS.with(|w| w.set(w.get() + 1));
        let read = |source| ScanError::Read { dir: dir.display().to_string(), source };
        let root = match std::fs::metadata(dir) {
            Ok(md) if md.is_dir() => md,
            _ => return Err(ScanError::NotADirectory(dir.display().to_string())),
        };
        let taken_ns = ns_since_epoch(std::time::SystemTime::now());
        let mut scan = DirScan { dir: dir.to_path_buf(), files: Vec::new(), skipped: Vec::new(), entries: vec![Entry::of(String::new(), &root)], taken_ns };
        let mut stack = vec![(dir.to_path_buf(), String::new())];
        while let Some((p, prefix)) = stack.pop() {
            for e in std::fs::read_dir(&p).map_err(read)? {
                let e = e.map_err(read)?;
                let name =
                    e.file_name().into_string().map_err(|n| read(io::Error::new(io::ErrorKind::InvalidData, format!("file name {n:?} is not UTF-8"))))?;
                let rel = if prefix.is_empty() { name } else { format!("{prefix}/{name}") };
                // Not followed: a symlink is an entry of its own (skipped).
                let md = e.metadata().map_err(read)?;
                if md.is_dir() {
                    stack.push((e.path(), rel.clone()));
                } else if md.is_file() {
                    scan.files.push(SourceFile {
                        name: rel.clone(),
                        path: e.path(),
                        size: md.len(),
                        mode: md.permissions().mode() & 0o7777,
                        role: Role::Other,
                    });
                } else {
                    scan.skipped.push(rel.clone());
                }
                scan.entries.push(Entry::of(rel, &md));
            }
        }
        scan.files.sort_by(|a, b| a.name.cmp(&b.name));
        scan.skipped.sort();
        scan.entries.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(scan)
    }

    /// Bytes of the regular files (holes included): what packing reads through.
    pub fn total_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.size).sum()
    }

    /// Refuse a directory with no regular file: an image of it would restore nothing, and
    /// a wrong path is likelier than a wish for one.
    pub fn require_files(&self) -> Result<(), ScanError> {
        if self.files.is_empty() {
            return Err(ScanError::NoFiles(self.dir.display().to_string()));
        }
        Ok(())
    }

    /// Whether every entry still has the metadata the walk found, each looked up by name
    /// (no listing): a write, a replacement, or an entry added, removed or renamed (which
    /// moves its directory's times) since the walk makes this false, as does an entry
    /// that cannot be looked up.
    pub fn unchanged(&self) -> bool {
        self.entries.iter().all(|e| {
            let md = if e.name.is_empty() { std::fs::metadata(&self.dir) } else { std::fs::symlink_metadata(self.dir.join(&e.name)) };
            md.is_ok_and(|md| Entry::of(e.name.clone(), &md) == *e)
        })
    }
}

/// `t` in nanoseconds since the epoch (0 before it, saturated far after it).
pub(crate) fn ns_since_epoch(t: std::time::SystemTime) -> i64 {
    t.duration_since(std::time::UNIX_EPOCH).map(|d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX)).unwrap_or(0)
}

fn base_name(name: &str) -> &str {
    name.rsplit('/').next().unwrap_or(name)
}

/// Guess the runtime from file names.
pub fn detect_kind(files: &[SourceFile]) -> Kind {
    let has = |n: &str| files.iter().any(|f| base_name(&f.name) == n);
    if has("checkpoint.img") || has("pages_meta.img") {
        Kind::Gvisor
    } else if has("inventory.img")
        || files.iter().any(|f| {
            let b = base_name(&f.name);
            (b.starts_with("pages-") || b.starts_with("pagemap-")) && b.ends_with(".img")
        })
    {
        Kind::Criu
    } else if has("vm.mem") || has("vm.state") || has("vmstate") || (has("memory") && (has("snapshot") || has("state"))) {
        Kind::Firecracker
    } else {
        Kind::Dir
    }
}

/// The role of a file within a snapshot of `kind`.
pub fn role_of(kind: Kind, name: &str) -> Role {
    let b = base_name(name);
    match kind {
        Kind::Firecracker => match b {
            "vm.mem" | "memory" | "mem" | "guest.mem" | "mem_file" => Role::Memory,
            _ if b.ends_with(".mem") => Role::Memory,
            "vm.state" | "vmstate" | "snapshot" | "state" | "snapshot_file" => Role::State,
            _ if b.ends_with(".state") || b.ends_with(".snap") => Role::State,
            _ => Role::Other,
        },
        Kind::Gvisor => match b {
            "checkpoint.img" => Role::State,
            "pages_meta.img" => Role::Metadata,
            "pages.img" => Role::Pages,
            _ => Role::Other,
        },
        Kind::Criu => {
            if b.starts_with("pages-") && b.ends_with(".img") {
                Role::Pages
            } else if b.ends_with(".img") {
                Role::Metadata
            } else {
                Role::Other
            }
        }
        Kind::Dir => Role::Other,
    }
}

/// Data extents of a file, as `[start, end)` byte ranges, from SEEK_DATA/SEEK_HOLE: holes
/// of sparse files are skipped without being read. Filesystems without hole support
/// report one extent covering the file.
pub fn data_extents(file: &File, size: u64) -> io::Result<Vec<(u64, u64)>> {
    let fd = file.as_raw_fd();
    let mut out = Vec::new();
    let mut pos: i64 = 0;
    let size = size as i64;
    while pos < size {
        // SAFETY: lseek on a valid descriptor we own; it touches no memory.
        let data = unsafe { libc::lseek(fd, pos, libc::SEEK_DATA) };
        if data < 0 {
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::ENXIO) => break, // no data past pos
                Some(libc::EINVAL) | Some(libc::EOPNOTSUPP) if out.is_empty() && pos == 0 => {
                    return Ok(vec![(0, size as u64)]);
                }
                _ => return Err(e),
            }
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(io::Error::last_os_error());
        }
        let end = hole.min(size);
        if end > data {
            out.push((data as u64, end as u64));
        }
        pos = hole;
    }
    Ok(out)
}

/// For chunk `[start, end)`: none of it is data, all of it, or part of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Coverage {
    Hole,
    Partial,
    Data,
}

/// Walks extents alongside increasing chunk ranges.
pub struct ExtentCursor<'a> {
    extents: &'a [(u64, u64)],
    i: usize,
}

impl<'a> ExtentCursor<'a> {
    pub fn new(extents: &'a [(u64, u64)]) -> Self {
        ExtentCursor { extents, i: 0 }
    }
    /// Coverage of `[start, end)`; calls must have non-decreasing `start`.
    pub fn coverage(&mut self, start: u64, end: u64) -> Coverage {
        while self.i < self.extents.len() && self.extents[self.i].1 <= start {
            self.i += 1;
        }
        let mut covered = 0;
        let mut j = self.i;
        while j < self.extents.len() && self.extents[j].0 < end {
            let (s, e) = self.extents[j];
            covered += e.min(end) - s.max(start);
            j += 1;
        }
        if covered == 0 {
            Coverage::Hole
        } else if covered == end - start {
            Coverage::Data
        } else {
            Coverage::Partial
        }
    }
    /// The data pieces inside `[start, end)`.
    pub fn pieces(&self, start: u64, end: u64) -> Vec<(u64, u64)> {
        self.extents[self.i..].iter().take_while(|(s, _)| *s < end).filter(|(_, e)| *e > start).map(|&(s, e)| (s.max(start), e.min(end))).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_and_roles() {
        let f = |names: &[&str]| -> Vec<SourceFile> {
            names.iter().map(|n| SourceFile { name: n.to_string(), path: n.into(), size: 0, mode: 0o644, role: Role::Other }).collect()
        };
        assert_eq!(detect_kind(&f(&["vm.mem", "vm.state"])), Kind::Firecracker);
        assert_eq!(detect_kind(&f(&["checkpoint.img"])), Kind::Gvisor);
        assert_eq!(detect_kind(&f(&["inventory.img", "pages-1.img", "pagemap-1.img"])), Kind::Criu);
        assert_eq!(detect_kind(&f(&["a.txt"])), Kind::Dir);
        assert_eq!(role_of(Kind::Firecracker, "vm.mem"), Role::Memory);
        assert_eq!(role_of(Kind::Firecracker, "vmstate"), Role::State);
        assert_eq!(role_of(Kind::Gvisor, "pages.img"), Role::Pages);
        assert_eq!(role_of(Kind::Criu, "pagemap-7.img"), Role::Metadata);
        assert_eq!(role_of(Kind::Criu, "pages-7.img"), Role::Pages);
    }

    /// One walk lists every entry (the directory itself, subdirectories, files, others)
    /// with its metadata, and counts as one walk of this thread.
    #[test]
    fn a_scan_lists_files_skipped_entries_and_every_entry() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("sub")).unwrap();
        std::fs::write(d.path().join("vm.mem"), vec![1u8; 8192]).unwrap();
        std::fs::write(d.path().join("sub/vm.state"), b"state").unwrap();
        std::os::unix::fs::symlink("vm.mem", d.path().join("link")).unwrap();
        let before = walks_on_this_thread();
        let scan = DirScan::take(d.path()).unwrap();
        assert_eq!(walks_on_this_thread(), before + 1);
        let names = |v: Vec<&str>| v.into_iter().map(String::from).collect::<Vec<_>>();
        assert_eq!(scan.files.iter().map(|f| f.name.clone()).collect::<Vec<_>>(), names(vec!["sub/vm.state", "vm.mem"]));
        assert_eq!(scan.skipped, ["link"]);
        assert_eq!(scan.entries.iter().map(|e| e.name.clone()).collect::<Vec<_>>(), names(vec!["", "link", "sub", "sub/vm.state", "vm.mem"]));
        assert_eq!(scan.total_bytes(), 8192 + 5);
        assert!(scan.require_files().is_ok());
        let empty = tempfile::tempdir().unwrap();
        std::fs::create_dir(empty.path().join("sub")).unwrap();
        let e = DirScan::take(empty.path()).unwrap().require_files().unwrap_err();
        assert!(e.to_string().ends_with(": nothing to pack: no regular file in it"), "{e}");
        let e = DirScan::take(&d.path().join("vm.mem")).unwrap_err();
        assert!(matches!(e, ScanError::NotADirectory(_)), "{e}");
    }

    /// Whether anything changed since the walk, looked up entry by entry (no listing): a
    /// write, a file added, renamed or removed, a mode changed.
    #[test]
    fn unchanged_sees_writes_additions_renames_removals_and_modes() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("sub")).unwrap();
        std::fs::write(d.path().join("vm.mem"), b"mem").unwrap();
        std::fs::write(d.path().join("sub/vm.state"), b"state").unwrap();
        let fresh = || DirScan::take(d.path()).unwrap();
        // Each change lands in a later tick of the file system's clock than the walk.
        let later = || std::thread::sleep(std::time::Duration::from_millis(20));
        let changes: [(&str, &dyn Fn()); 5] = [
            ("a write", &|| std::fs::write(d.path().join("vm.mem"), b"MEM").unwrap()),
            ("a file added in a subdirectory", &|| std::fs::write(d.path().join("sub/new"), b"").unwrap()),
            ("a rename", &|| std::fs::rename(d.path().join("sub/new"), d.path().join("sub/newer")).unwrap()),
            ("a removal", &|| std::fs::remove_file(d.path().join("sub/newer")).unwrap()),
            ("a mode", &|| std::fs::set_permissions(d.path().join("vm.mem"), std::fs::Permissions::from_mode(0o600)).unwrap()),
        ];
        for (what, change) in changes {
            let scan = fresh();
            assert!(scan.unchanged(), "nothing changed yet ({what})");
            later();
            change();
            assert!(!scan.unchanged(), "{what} went unseen");
        }
    }

    #[test]
    fn sparse_extents() {
        use std::io::{Seek, SeekFrom, Write};
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("s");
        let mut f = File::create(&p).unwrap();
        f.set_len(8 << 20).unwrap();
        f.seek(SeekFrom::Start(2 << 20)).unwrap();
        f.write_all(&[1u8; 4096]).unwrap();
        f.sync_all().unwrap();
        let f = File::open(&p).unwrap();
        let ex = data_extents(&f, 8 << 20).unwrap();
        let total: u64 = ex.iter().map(|(s, e)| e - s).sum();
        assert!(total < (1 << 20), "holes skipped: {ex:?}");
        let mut c = ExtentCursor::new(&ex);
        assert_eq!(c.coverage(0, 1 << 20), Coverage::Hole);
        assert_ne!(c.coverage(2 << 20, 3 << 20), Coverage::Hole);
        assert_eq!(c.coverage(4 << 20, 5 << 20), Coverage::Hole);
    }

    #[test]
    fn cursor_partial() {
        let ex = [(10, 20), (30, 40)];
        let mut c = ExtentCursor::new(&ex);
        assert_eq!(c.coverage(0, 10), Coverage::Hole);
        assert_eq!(c.coverage(10, 20), Coverage::Data);
        assert_eq!(c.coverage(15, 35), Coverage::Partial);
        assert_eq!(c.pieces(15, 35), vec![(15, 20), (30, 35)]);
        assert_eq!(c.coverage(40, 50), Coverage::Hole);
    }
}
