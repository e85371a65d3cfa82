//! A local record of which repositories of a registry hold which blobs, so a push can
//! cross-mount a parent's packs from the repository they were pushed to (or pulled from)
//! instead of uploading them again.
//!
//! One append-only text file per host under the cache directory,
//! `known-blobs/<host>.txt`, one `<digest> <repository>` line per blob and repository.
//! Appends of whole short lines with `O_APPEND` do not interleave, so concurrent pushes
//! and pulls may record at once. A wrong or stale line costs one refused mount (the
//! registry answers 202 and the blob is uploaded), never a wrong blob: mounting is by
//! digest, so the registry itself guarantees the content.

use std::collections::{BTreeSet, HashMap};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use imgfmt::OciDigest;

/// Above this size the record is compacted (duplicates dropped) when next loaded.
const COMPACT_AT: u64 = 16 << 20;
/// Never read more than this (a bound on memory, whatever is in the file).
const MAX_READ: u64 = 64 << 20;

/// The blobs → repositories record of one registry host.
pub struct KnownBlobs {
    path: PathBuf,
}

impl KnownBlobs {
    /// The record of `host` under `cache_dir`.
    pub fn new(cache_dir: &Path, host: &str) -> Self {
        let safe: String = host.chars().map(|c| if c.is_ascii_alphanumeric() || c == '.' || c == '-' { c } else { '_' }).collect();
        KnownBlobs { path: cache_dir.join("known-blobs").join(format!("{safe}.txt")) }
    }

    /// Everything recorded: digest → repositories. A missing or unreadable file is empty.
    pub fn load(&self) -> HashMap<OciDigest, BTreeSet<String>> {
        let mut map: HashMap<OciDigest, BTreeSet<String>> = HashMap::new();
        let Ok(f) = std::fs::File::open(&self.path) else { return map };
        let mut text = String::new();
        if f.take(MAX_READ).read_to_string(&mut text).is_err() {
            return map;
        }
        let mut lines = 0u64;
        for line in text.lines() {
            lines += 1;
            let Some((d, repo)) = line.split_once(' ') else { continue };
            if imgfmt::reference::check_repository(repo).is_err() {
                continue;
            }
            if let Ok(d) = d.parse::<OciDigest>() {
                map.entry(d).or_default().insert(repo.to_string());
            }
        }
        let unique: u64 = map.values().map(|s| s.len() as u64).sum();
        if text.len() as u64 > COMPACT_AT && unique < lines {
            let mut out = String::new();
            for (d, repos) in &map {
                for r in repos {
                    out.push_str(&format!("{d} {r}\n"));
                }
            }
            let _ = super::config::write_private(&self.path, out.as_bytes());
        }
        map
    }

    /// Repositories other than `except` recorded as holding `d`.
    pub fn repos_with(map: &HashMap<OciDigest, BTreeSet<String>>, d: &OciDigest, except: &str) -> Vec<String> {
        map.get(d).map(|s| s.iter().filter(|r| r.as_str() != except).cloned().collect()).unwrap_or_default()
    }

    /// Record that `repository` holds each of `digests`. Best effort: a cache that cannot
    /// be written only costs later mounts.
    pub fn record<'a>(&self, repository: &str, digests: impl IntoIterator<Item = &'a OciDigest>) {
        let text: String = digests.into_iter().map(|d| format!("{d} {repository}\n")).collect();
        if text.is_empty() {
            return;
        }
        let res = (|| {
            std::fs::create_dir_all(self.path.parent().expect("has a parent"))?;
            let mut f = std::fs::OpenOptions::new().create(true).append(true).open(&self.path)?;
            f.write_all(text.as_bytes())
        })();
        if let Err(e) = res {
            tracing::debug!(path = %self.path.display(), "cannot record known blobs: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_and_load() {
        let dir = tempfile::tempdir().unwrap();
        let k = KnownBlobs::new(dir.path(), "127.0.0.1:5000");
        assert!(k.load().is_empty());
        let a = OciDigest::of(b"a");
        let b = OciDigest::of(b"b");
        k.record("vm/base", [&a, &b]);
        k.record("vm/next", [&a]);
        k.record("vm/next", [&a]);
        std::fs::OpenOptions::new().append(true).open(&k.path).unwrap().write_all(b"garbage\nsha256:zz x\n").unwrap();
        let m = k.load();
        assert_eq!(KnownBlobs::repos_with(&m, &a, "vm/other"), vec!["vm/base".to_string(), "vm/next".into()]);
        assert_eq!(KnownBlobs::repos_with(&m, &a, "vm/base"), vec!["vm/next".to_string()]);
        assert!(KnownBlobs::repos_with(&m, &OciDigest::of(b"c"), "x").is_empty());
        assert!(k.path.to_string_lossy().ends_with("127.0.0.1_5000.txt"));
    }
}
