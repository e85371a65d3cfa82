//! Before anything is mounted: is DIR a place to show an image, and can this process
//! mount at all? Each refusal is one line naming what to do. And afterwards: which image
//! a DIR shows (`/proc/self/mountinfo`).

use std::path::{Path, PathBuf};

/// The file system type the host mount shows in `/proc/self/mountinfo`.
pub const FSTYPE: &str = "fuse.snapctl";

/// Why DIR cannot show an image, or this process cannot mount.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum TargetError {
    /// {0}: no such directory: create an empty directory there first
    Missing(String),
    /// {0}: not a directory: give an empty directory
    NotDir(String),
    /// {0}: not empty: mount onto an empty directory
    NotEmpty(String),
    /// {0}: already a mount point ({1}): unmount it first, or choose another directory
    MountPoint(String, String),
    /// {0}: cannot be read: {1}
    Unreadable(String, std::io::Error),
    /// no /dev/fuse on this host: load the fuse module (modprobe fuse), or give the container the device
    NoFuse,
    /// mounting needs root (CAP_SYS_ADMIN), which this process lacks: run snapctl mount as root
    NotPermitted,
    /// {0}: not an image mounted by snapctl mount (its file system is {1})
    NotOurs(String, String),
}

/// `dir` made absolute (symlinks resolved), once it is an empty directory that is not a
/// mount point.
pub fn check_dir(dir: &Path) -> Result<PathBuf, TargetError> {
    let shown = dir.display().to_string();
    let meta = match std::fs::metadata(dir) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(TargetError::Missing(shown)),
        Err(e) => return Err(TargetError::Unreadable(shown, e)),
    };
    if !meta.is_dir() {
        return Err(TargetError::NotDir(shown));
    }
    let abs = dir.canonicalize().map_err(|e| TargetError::Unreadable(shown.clone(), e))?;
    if let Some(m) = mount_at(&abs) {
        return Err(TargetError::MountPoint(shown, m.fstype));
    }
    let mut entries = std::fs::read_dir(&abs).map_err(|e| TargetError::Unreadable(shown.clone(), e))?;
    if entries.next().is_some() {
        return Err(TargetError::NotEmpty(shown));
    }
    Ok(abs)
}

/// Whether this process can mount: `/dev/fuse` is there, and it has `CAP_SYS_ADMIN`
/// (the host mount and the binds into DIRs are `mount(2)`s).
pub fn check_host() -> Result<(), TargetError> {
    if !Path::new("/dev/fuse").exists() {
        return Err(TargetError::NoFuse);
    }
    if !has_sys_admin() {
        return Err(TargetError::NotPermitted);
    }
    Ok(())
}

/// `CAP_SYS_ADMIN` (bit 21) in this process's effective set (`/proc/self/status`).
fn has_sys_admin() -> bool {
    const CAP_SYS_ADMIN: u32 = 21;
    let Ok(s) = std::fs::read_to_string("/proc/self/status") else { return false };
    s.lines().find_map(|l| l.strip_prefix("CapEff:")).and_then(|h| u64::from_str_radix(h.trim(), 16).ok()).is_some_and(|caps| caps & (1 << CAP_SYS_ADMIN) != 0)
}

/// One line of `/proc/self/mountinfo`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    /// `major:minor` of the mounted file system.
    pub dev: String,
    /// The directory of that file system the mount shows (`/` for the whole of it).
    pub root: String,
    pub mount_point: PathBuf,
    pub fstype: String,
}

/// Every mount this process sees, in the order mounted.
pub fn mountinfo() -> Vec<MountEntry> {
    std::fs::read_to_string("/proc/self/mountinfo").map(|s| s.lines().filter_map(parse_mountinfo_line).collect()).unwrap_or_default()
}

/// The mount on top at `dir` (absolute), if `dir` is a mount point.
pub fn mount_at(dir: &Path) -> Option<MountEntry> {
    mountinfo().into_iter().rev().find(|m| m.mount_point == dir)
}

/// The host mount (root `/` of the same file system) of a mount of ours.
pub fn host_of(m: &MountEntry) -> Option<MountEntry> {
    mountinfo().into_iter().rev().find(|h| h.dev == m.dev && h.root == "/" && h.fstype == FSTYPE)
}

/// `36 35 98:0 /mnt1 /mnt/parent rw,noatime master:1 - ext3 /dev/root rw` (proc(5)).
fn parse_mountinfo_line(line: &str) -> Option<MountEntry> {
    let (left, right) = line.split_once(" - ")?;
    let f: Vec<&str> = left.split(' ').collect();
    let fstype = right.split(' ').next()?;
    Some(MountEntry { dev: f.get(2)?.to_string(), root: unescape(f.get(3)?), mount_point: PathBuf::from(unescape(f.get(4)?)), fstype: fstype.to_string() })
}

/// Undo mountinfo's octal escapes (`\040` is a space).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c)) {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_lines_are_read_with_their_escapes() {
        let m = parse_mountinfo_line("612 28 0:77 /sha256:ab /srv/my\\040vm rw,nosuid,nodev,relatime shared:1 - fuse.snapctl snapctl ro,user_id=0").unwrap();
        assert_eq!(m, MountEntry { dev: "0:77".into(), root: "/sha256:ab".into(), mount_point: "/srv/my vm".into(), fstype: FSTYPE.into() });
        assert!(parse_mountinfo_line("garbage").is_none());
    }

    #[test]
    fn a_missing_file_or_full_directory_is_refused_by_name() {
        let t = tempfile::tempdir().unwrap();
        let missing = t.path().join("nope");
        assert!(matches!(check_dir(&missing), Err(TargetError::Missing(_))));
        std::fs::write(t.path().join("f"), b"x").unwrap();
        assert!(matches!(check_dir(&t.path().join("f")), Err(TargetError::NotDir(_))));
        assert!(matches!(check_dir(t.path()), Err(TargetError::NotEmpty(_))));
        let empty = t.path().join("e");
        std::fs::create_dir(&empty).unwrap();
        assert_eq!(check_dir(&empty).unwrap(), empty.canonicalize().unwrap());
        assert!(matches!(check_dir(Path::new("/proc")), Err(TargetError::MountPoint(_, fs)) if fs == "proc"));
    }
}
