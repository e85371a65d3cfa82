//! Reading a checkpoint directory: which runtime wrote it, what each file is, and where
//! the data (as opposed to holes) of sparse files is.

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

/// Entries that are not regular files (sockets, symlinks, devices) are skipped and
/// reported, not silently dropped.
#[derive(Debug, Default)]
pub struct Scan {
    pub files: Vec<SourceFile>,
    pub skipped: Vec<String>,
}

/// Walk `dir` (recursively, names sorted bytewise) and collect its regular files.
pub fn scan_dir(dir: &Path) -> io::Result<Scan> {
    let mut scan = Scan::default();
    let mut stack = vec![(dir.to_path_buf(), String::new())];
    while let Some((p, prefix)) = stack.pop() {
        for e in std::fs::read_dir(&p)? {
            let e = e?;
            let name = e.file_name().into_string().map_err(|n| io::Error::new(io::ErrorKind::InvalidData, format!("file name {n:?} is not UTF-8")))?;
            let rel = if prefix.is_empty() { name } else { format!("{prefix}/{name}") };
            let ft = e.file_type()?;
            if ft.is_dir() {
                stack.push((e.path(), rel));
            } else if ft.is_file() {
                let md = e.metadata()?;
                scan.files.push(SourceFile { name: rel, path: e.path(), size: md.len(), mode: md.permissions().mode() & 0o7777, role: Role::Other });
            } else {
                scan.skipped.push(rel);
            }
        }
    }
    scan.files.sort_by(|a, b| a.name.cmp(&b.name));
    scan.skipped.sort();
    Ok(scan)
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
