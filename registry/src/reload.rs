//! Taking htpasswd changes without a restart, as distribution does: the file is polled
//! for a new modification time, size or inode (an editor that writes a new file and
//! renames it over the old one changes the inode), and reloaded on demand (`serve`
//! reloads on SIGHUP). A file that cannot be read or parsed whole (a line cut inside its
//! hash, no user at all: a file caught while it is written) leaves the users as they were
//! (a warning in the log), and is tried again at the next change.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::SystemTime;

use crate::auth::Auth;

/// What identifies one version of the file.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Stamp {
    modified: SystemTime,
    len: u64,
    dev: u64,
    ino: u64,
}

fn stamp(path: &Path) -> std::io::Result<Stamp> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path)?;
    Ok(Stamp { modified: m.modified()?, len: m.len(), dev: m.dev(), ino: m.ino() })
}

/// An htpasswd file and the version of it that the users were loaded from.
#[derive(Debug)]
pub struct HtpasswdFile {
    path: PathBuf,
    loaded: Mutex<Option<Stamp>>,
}

impl HtpasswdFile {
    /// The file at `path`. Its current version counts as loaded: the caller built the
    /// [`Auth`] from it just before.
    pub fn new(path: &Path) -> HtpasswdFile {
        HtpasswdFile { path: path.to_owned(), loaded: Mutex::new(stamp(path).ok()) }
    }

    /// Reload `auth`'s users when the file changed since it was last loaded, or always
    /// with `force`. Blocking (reads the file, hashes with bcrypt): call off the reactor.
    /// Returns whether the users were replaced.
    pub fn check(&self, auth: &Auth, force: bool) -> bool {
        let now = match stamp(&self.path) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(path = %self.path.display(), %e, "htpasswd file unreadable; keeping the users loaded before");
                return false;
            }
        };
        let mut loaded = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
        if !force && loaded.as_ref() == Some(&now) {
            return false;
        }
        let text = match std::fs::read_to_string(&self.path) {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!(path = %self.path.display(), %e, "htpasswd file unreadable; keeping the users loaded before");
                return false;
            }
        };
        // Remember this version even when it is bad: it is reported once, not every poll.
        *loaded = Some(now);
        match auth.reload_users(&text) {
            Ok(n) => {
                tracing::info!(path = %self.path.display(), users = n, "htpasswd file reloaded");
                true
            }
            Err(e) => {
                tracing::warn!(path = %self.path.display(), %e, "htpasswd file not reloaded; keeping the users loaded before");
                false
            }
        }
    }
}
