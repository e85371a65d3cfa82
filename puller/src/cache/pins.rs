//! Pins: the chunks a running restore (a lazy daemon, a mount) must keep in the cache for as
//! long as it runs, kept out of every eviction (the budget's and `snapctl cache prune`'s,
//! `--all` too) by whichever process evicts.
//!
//! ```text
//! <root>/chunks/v1/pins/<pid>-<seq>-<nanos>.pin     one per live pin, flock'd (shared) by its holder
//! <root>/chunks/v1/pins/.<pid>-<seq>-<nanos>.tmp    a pin being written (its holder locks it first)
//! ```
//!
//! A pin file is a line `snapctl-pin v1 <label>` followed by one line per chunk,
//! `<algo>:<64 hex>` (spec/cache.md §4.1). Its holder creates it under a temp name, locks
//! it, writes it and renames it into place, and removes it (still locked) when the pin is
//! dropped. A pass tells a live pin from a dead holder's by trying the lock exclusively
//! without waiting: held, it is live and its chunks are pinned; free, its holder is gone
//! (killed) and the pass deletes it. So a pin never outlives its process by more than the
//! next pass.

use std::collections::HashSet;
use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Read, Write};
use std::os::unix::fs::MetadataExt;

use imgfmt::file::Dir;
use imgfmt::{ChunkDigest, HashAlgo};

/// Header of a pin file.
const MAGIC: &str = "snapctl-pin v1";
const SUFFIX: &str = ".pin";
/// Most of one pin file read: 64 MiB is 900 000 chunks (900 GiB of 1 MiB chunks); lines
/// past it pin nothing.
pub(super) const MAX_PIN_BYTES: u64 = 64 << 20;

/// Chunks named by pins, by algorithm and digest.
pub(super) type Pinned = HashSet<(HashAlgo, ChunkDigest)>;

/// The live pins under `dir` (`chunks/v1/pins`): every chunk they name, and how many pins.
/// With `remove_stale` (a pass, holding the pass lock), pin files whose holder is gone and
/// temps of writers that no longer run are deleted. Best effort: a file that cannot be read
/// pins nothing.
pub(super) fn live(dir: &Dir, remove_stale: bool, writer_runs: impl Fn(u32) -> bool) -> (Pinned, u64) {
    let mut pinned = Pinned::new();
    let mut pins = 0;
    let Ok(names) = dir.names() else { return (pinned, 0) };
    for name in names {
        let Some(text) = name.to_str() else { continue };
        if let Some(rest) = text.strip_prefix('.').and_then(|t| t.strip_suffix(".tmp")) {
            // A pin being written: its writer locks it right after creating it; one whose
            // writer is gone is a kill's leftover.
            let pid = rest.split('-').next().and_then(|p| p.parse::<u32>().ok());
            if remove_stale && !pid.is_some_and(&writer_runs) {
                let _ = dir.remove_file(&name);
            }
            continue;
        }
        if !text.ends_with(SUFFIX) {
            continue;
        }
        let Ok(f) = dir.open_regular(&name) else { continue };
        match f.try_lock() {
            Ok(()) => {
                // Nobody holds it: its holder is gone. Deleted only if the name still names
                // the file locked (a holder may have just removed it and another taken the name).
                if remove_stale && still_named(dir, &name, &f) {
                    let _ = dir.remove_file(&name);
                }
            }
            Err(std::fs::TryLockError::WouldBlock) => {
                pins += 1;
                read_into(f, &mut pinned);
            }
            Err(std::fs::TryLockError::Error(e)) => tracing::debug!("{}: {e}", dir.display_path(&name).display()),
        }
    }
    (pinned, pins)
}

fn still_named(dir: &Dir, name: &OsStr, f: &File) -> bool {
    let (Ok(held), Ok(now)) = (f.metadata(), std::fs::symlink_metadata(dir.display_path(name))) else { return false };
    held.ino() == now.ino() && held.dev() == now.dev()
}

/// The chunks a pin file lists, into `out` (at most [`MAX_PIN_BYTES`] read; a file that
/// does not start with the header pins nothing, a line that is not a chunk is skipped).
fn read_into(f: File, out: &mut Pinned) {
    let mut lines = BufReader::new(f.take(MAX_PIN_BYTES)).lines();
    if !lines.next().and_then(Result::ok).is_some_and(|h| h.starts_with(MAGIC)) {
        return;
    }
    for line in lines.map_while(Result::ok) {
        let Some((algo, _)) = line.split_once(':') else { continue };
        let Ok(algo) = algo.parse::<HashAlgo>() else { continue };
        if let Ok(d) = ChunkDigest::parse_with(&line, algo) {
            out.insert((algo, d));
        }
    }
}

/// A pin file being held: created under a temp name, locked (shared), written, renamed into
/// place. Returns the open, locked file and its name in `dir`.
pub(super) fn create(dir: &Dir, unique: &str, label: &str, chunks: &[(HashAlgo, ChunkDigest)]) -> std::io::Result<(File, OsString)> {
    let tmp = OsString::from(format!(".{unique}.tmp"));
    let name = OsString::from(format!("{unique}{SUFFIX}"));
    let f = dir.create_new(&tmp, 0o644)?;
    let written = (|| {
        f.lock_shared()?;
        let mut w = BufWriter::new(&f);
        // One line: whatever the caller wrote, newlines and all, stays on it.
        let label: String = label.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
        writeln!(w, "{MAGIC} {label}")?;
        for (algo, d) in chunks {
            writeln!(w, "{}", d.display_with(*algo))?;
        }
        w.flush()?;
        drop(w);
        dir.rename(&tmp, &name, false)
    })();
    if let Err(e) = written {
        let _ = dir.remove_file(&tmp);
        return Err(e);
    }
    Ok((f, name))
}
