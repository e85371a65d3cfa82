//! Resume state of a chunked upload, one small JSON file per (registry, repository, blob)
//! under the cache directory: `uploads/<sha256 of "host/repo@digest", 32 hex>.json`.
//!
//! It holds the upload session's URL (`Location`, which some registries change after every
//! PATCH: distribution encodes the offset in a signed `_state` query parameter) and the
//! offset the client last saw committed. On a rerun the client asks the registry for the
//! session's real offset (GET → `Range`) and continues from there; the saved offset is
//! only for messages. A file whose session is gone makes the client start over.

use std::path::{Path, PathBuf};

use imgfmt::OciDigest;
use serde::{Deserialize, Serialize};

/// What is saved about one upload in progress.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UploadState {
    pub host: String,
    pub repository: String,
    pub digest: OciDigest,
    /// Absolute session URL, as last returned by the registry.
    pub location: String,
    /// Bytes the registry had confirmed when this was written.
    pub offset: u64,
}

/// State files are a few hundred bytes; anything bigger is not ours.
const MAX_STATE_BYTES: u64 = 64 << 10;

/// Path of the state file for one upload.
pub fn state_path(cache_dir: &Path, host: &str, repository: &str, digest: &OciDigest) -> PathBuf {
    let key = OciDigest::of(format!("{host}/{repository}@{digest}").as_bytes());
    cache_dir.join("uploads").join(format!("{}.json", &key.hex()[..32]))
}

/// Load a state file; `None` when absent, unreadable, or about another upload (the name
/// is a hash, so the content is checked too).
pub fn load(path: &Path, host: &str, repository: &str, digest: &OciDigest) -> Option<UploadState> {
    use std::io::Read;
    let f = std::fs::File::open(path).ok()?;
    let mut b = Vec::new();
    f.take(MAX_STATE_BYTES).read_to_end(&mut b).ok()?;
    let s: UploadState = serde_json::from_slice(&b).ok()?;
    (s.host == host && s.repository == repository && &s.digest == digest).then_some(s)
}

/// Save atomically (a torn state file would be worse than none).
pub fn save(path: &Path, s: &UploadState) -> std::io::Result<()> {
    super::config::write_private(path, &serde_json::to_vec(s).expect("serializes"))
}

/// Forget an upload (finished, or its session is gone).
pub fn remove(path: &Path) {
    let _ = std::fs::remove_file(path);
}

/// Parse an upload `Range` header (`0-<last>`, also `bytes=0-<last>`) into the number of
/// bytes the registry holds. `0-0` is read as 0 bytes: registries send it for an empty
/// session, and snapctl never leaves a session holding exactly one byte (every PATCH is
/// a whole piece), so the ambiguity costs at most one byte re-sent by other clients.
pub fn parse_upload_range(v: &str) -> Option<u64> {
    let v = v.trim();
    let v = v.strip_prefix("bytes=").unwrap_or(v);
    let (a, b) = v.split_once('-')?;
    let (a, b): (u64, u64) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
    if a != 0 {
        return None;
    }
    Some(if b == 0 { 0 } else { b.checked_add(1)? })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges() {
        assert_eq!(parse_upload_range("0-0"), Some(0));
        assert_eq!(parse_upload_range("0-1048575"), Some(1 << 20));
        assert_eq!(parse_upload_range("bytes=0-99"), Some(100));
        assert_eq!(parse_upload_range(" 0-9 "), Some(10));
        assert_eq!(parse_upload_range("5-9"), None);
        assert_eq!(parse_upload_range("0-"), None);
        assert_eq!(parse_upload_range("junk"), None);
        assert_eq!(parse_upload_range("0-18446744073709551615"), None);
    }

    #[test]
    fn state_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let d = OciDigest::of(b"x");
        let p = state_path(dir.path(), "h:1", "r/s", &d);
        assert_ne!(p, state_path(dir.path(), "h:1", "r/t", &d));
        assert!(load(&p, "h:1", "r/s", &d).is_none());
        let s =
            UploadState { host: "h:1".into(), repository: "r/s".into(), digest: d.clone(), location: "http://h:1/v2/r/s/blobs/uploads/abc".into(), offset: 7 };
        save(&p, &s).unwrap();
        assert_eq!(load(&p, "h:1", "r/s", &d), Some(s));
        assert!(load(&p, "h:1", "r/other", &d).is_none(), "content is checked, not only the name");
        std::fs::write(&p, b"{torn").unwrap();
        assert!(load(&p, "h:1", "r/s", &d).is_none());
        remove(&p);
        assert!(!p.exists());
    }
}
