//! The stamp of a directory a push packed: its walk's entries ([`DirScan::entries`]) and
//! the manifest they were packed to, so that a push of the unchanged directory skips
//! packing (spec/transfer.md §2).

use std::path::Path;

use imgfmt::OciDigest;

use crate::scan::{DirScan, Entry};

/// What a directory looked like when it was packed: every entry (recursively, the
/// directory itself included) with the metadata any change moves. A write to a file
/// always sets its ctime (which no user call can set back), a replaced file has another
/// inode, a renamed or removed one changes the names, so an equal stamp means the files
/// hold what was packed.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub(crate) struct Stamp {
    /// snapctl version and pack options: another version or option packs differently.
    options: String,
    entries: Vec<Entry>,
    /// When the stamp was taken (ns since the epoch).
    taken_ns: i64,
    /// Manifest the directory was packed to (empty until packed).
    manifest: String,
}

/// A stamp file larger than this is not ours (a directory of a million entries is ~150 MB
/// of JSON; checkpoint directories hold a handful).
const MAX_STAMP_BYTES: u64 = 64 << 20;

impl Stamp {
    /// The stamp of the directory `scan` walked, packed with `options`.
    pub(crate) fn of(scan: &DirScan, options: &str) -> Stamp {
        Stamp { options: options.to_string(), entries: scan.entries.clone(), taken_ns: scan.taken_ns, manifest: String::new() }
    }

    /// This stamp, recorded as packed to `manifest`.
    pub(crate) fn packed_to(self, manifest: &OciDigest) -> Stamp {
        Stamp { manifest: manifest.to_string(), ..self }
    }

    /// A file changed within a clock tick of the stamp: a second write in that same tick
    /// would leave mtime and ctime (and maybe size) as they are, so such a stamp is not
    /// recorded. The kernel stamps files from a coarse clock (ticks of up to 10 ms); on a
    /// file system with whole-second times (every nanosecond field 0) the margin is 2 s.
    pub(crate) fn racy(&self) -> bool {
        let whole_seconds = self.entries.iter().all(|e| e.ctime_ns % 1_000_000_000 == 0 && e.mtime_ns % 1_000_000_000 == 0);
        let margin: i64 = if whole_seconds { 2_000_000_000 } else { 20_000_000 };
        self.entries.iter().any(|e| e.ctime_ns.max(e.mtime_ns) >= self.taken_ns.saturating_sub(margin))
    }

    /// The manifest recorded at `path` when its stamp's options and entries equal `now`'s.
    /// Any problem reading it means "not recorded": the directory is packed again.
    pub(crate) fn recorded(path: &Path, now: &Stamp) -> Option<OciDigest> {
        use std::io::Read;
        let mut bytes = Vec::new();
        std::fs::File::open(path).ok()?.take(MAX_STAMP_BYTES).read_to_end(&mut bytes).ok()?;
        let old: Stamp = serde_json::from_slice(&bytes).ok()?;
        (old.options == now.options && old.entries == now.entries).then(|| old.manifest.parse().ok()).flatten()
    }

    /// Written atomically (and synced), so a reader sees a whole stamp or none.
    pub(crate) fn save(&self, path: &Path) -> std::io::Result<()> {
        imgfmt::layout::write_atomic_mode(path, &serde_json::to_vec(self)?, 0o666)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch() -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("sub")).unwrap();
        std::fs::write(d.path().join("vm.mem"), vec![1u8; 8192]).unwrap();
        std::fs::write(d.path().join("sub/vm.state"), b"state").unwrap();
        d
    }

    fn stamp(d: &Path, options: &str) -> Stamp {
        Stamp::of(&DirScan::take(d).unwrap(), options)
    }

    #[test]
    fn stamp_lists_every_entry_and_sees_renames_removals_and_options() {
        let d = scratch();
        let s = stamp(d.path(), "o");
        let names: Vec<&str> = s.entries.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["", "sub", "sub/vm.state", "vm.mem"]);
        assert_eq!(s.entries[3].size, 8192);
        assert_eq!(stamp(d.path(), "o").entries, s.entries, "nothing changed");

        // Saved and read back: the manifest for the same stamp, nothing for other options
        // or another directory state.
        let file = d.path().with_extension("stamp.json");
        let digest = OciDigest::of(b"manifest");
        stamp(d.path(), "o").packed_to(&digest).save(&file).unwrap();
        assert_eq!(Stamp::recorded(&file, &stamp(d.path(), "o")), Some(digest));
        assert_eq!(Stamp::recorded(&file, &stamp(d.path(), "other options")), None);
        std::fs::rename(d.path().join("sub/vm.state"), d.path().join("sub/vm.state2")).unwrap();
        assert_eq!(Stamp::recorded(&file, &stamp(d.path(), "o")), None, "renamed");
        std::fs::remove_file(d.path().join("sub/vm.state2")).unwrap();
        assert_ne!(stamp(d.path(), "o").entries, s.entries, "removed");
        // A damaged stamp file is "not recorded", not an error.
        std::fs::write(&file, b"{not json").unwrap();
        assert_eq!(Stamp::recorded(&file, &s), None);
        std::fs::remove_file(&file).unwrap();
    }

    /// Files written just now could be written again within the same clock tick without
    /// their times moving: such a stamp must not be recorded.
    #[test]
    fn a_stamp_of_files_written_just_now_is_racy() {
        let d = scratch();
        assert!(stamp(d.path(), "o").racy());
        let mut old = stamp(d.path(), "o");
        old.taken_ns += 60_000_000_000;
        assert!(!old.racy(), "a minute later the same times are safe");
    }
}
