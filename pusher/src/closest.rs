//! Which image of a repository a new image of a directory is made over, when no parent is
//! named: the closest one already there, by relation, not by tag name.
//!
//! ```text
//! tags/list (up to MAX_LISTED) -> drop signature and referrer tags (sha256-…)
//!   -> the destination tag, then the last `max` others (registry order, latest name first)
//!   -> each: manifest + config (small blobs) -> same files? (kind, chunking, file names)
//!   -> rank: the image this directory was last packed to, then newest `created`, then tag
//!   -> the first FINALISTS: open (index), compare SAMPLE non-zero chunks of the directory
//!   -> most chunks equal wins (ties: rank); none equal: no parent
//! ```
//!
//! The sample is what makes "the same files" a relation: two sandboxes of one runtime
//! have the same file names, and a layer over the other one would send everything anyway.
//! Nothing here is trusted beyond ranking: the packer reads the chosen image through
//! verified readers, and a wrong choice costs bytes, never a wrong image.

use std::os::unix::fs::FileExt;

use imgfmt::{media, BlobSource, ChunkDigest, Image, ImageConfig, Manifest, OciDigest};
use regclient::RegistrySource;

use crate::pack::{same_files_of_config, PackOptions};
use crate::scan::DirScan;

/// Tags of the repository examined at most besides the destination tag (the last ones
/// in the registry's order: time-stamped names sort by time).
pub const DEFAULT_CANDIDATES: usize = 32;
/// Tags listed at most: a repository with more is examined among its first this many.
const MAX_LISTED: usize = 10_000;
/// Images of the same files whose chunks are compared with the directory's.
const FINALISTS: usize = 4;
/// Non-zero chunks of the directory compared with each finalist's.
const SAMPLE: usize = 32;
/// Chunk positions read at most while looking for non-zero ones.
const SAMPLE_READS: usize = 8 * SAMPLE;

/// The image chosen, and why.
#[derive(Debug, Clone)]
pub struct Closest {
    pub tag: String,
    pub digest: OciDigest,
    /// Why it was taken, for people (`"the tag holds an image of the same files"`).
    pub why: String,
}

/// What the search found: the image chosen, or why none was.
#[derive(Debug, Clone)]
pub struct Search {
    pub chosen: Option<Closest>,
    /// Why nothing was chosen (when `chosen` is `None`).
    pub none_because: String,
}

/// One image of the same files as the directory.
struct Candidate {
    tag: String,
    digest: OciDigest,
    created: Option<time::OffsetDateTime>,
    last_packed: bool,
    is_dest_tag: bool,
}

/// The image of `dest`'s repository (read through `source`, which may hold some of its
/// metadata locally) that a new image of the directory `scan` lists, packed with `opts`,
/// is best made over;
/// `tag` is the destination tag, `last_packed` the manifest the directory was packed to
/// last (ranked first among equals), `max` how many other tags are examined. A registry
/// that does not list its tags leaves only the destination tag.
pub fn closest_image(
    dest: &RegistrySource,
    source: &dyn BlobSource,
    scan: &DirScan,
    opts: &PackOptions,
    tag: &str,
    last_packed: Option<&OciDigest>,
    max: usize,
) -> Search {
    let none = |why: String| Search { chosen: None, none_because: why };
    let listed = match dest.tags_up_to(MAX_LISTED) {
        Ok(t) => t.map(|t| t.tags).unwrap_or_default(),
        Err(e) => {
            tracing::debug!("{}: {e}", dest.describe());
            vec![tag.to_string()]
        }
    };
    let mut names: Vec<&str> = listed.iter().map(String::as_str).filter(|t| *t != tag && !t.starts_with("sha256-")).collect();
    names.reverse();
    names.truncate(max);
    if listed.iter().any(|t| t == tag) {
        names.insert(0, tag);
    }
    if names.is_empty() {
        return none(format!("{} holds no image yet", dest.describe()));
    }
    let mut found: Vec<Candidate> = Vec::new();
    for t in &names {
        let Some(c) = same_files_candidate(source, t, scan, opts) else { continue };
        if !found.iter().any(|f| f.digest == c.1) {
            found.push(Candidate { tag: t.to_string(), digest: c.1.clone(), created: c.0, last_packed: Some(&c.1) == last_packed, is_dest_tag: *t == tag });
        }
    }
    if found.is_empty() {
        return none(format!("none of the {} tag(s) of {} examined holds an image of the same files", names.len(), dest.describe()));
    }
    // The destination tag first (a push to the tag it came from), then the image the
    // directory was packed to last, then the newest.
    found.sort_by(|a, b| (b.is_dest_tag, b.last_packed, b.created, &b.tag).cmp(&(a.is_dest_tag, a.last_packed, a.created, &a.tag)));
    let sample = sample_chunks(scan, opts);
    let mut best: Option<(usize, &Candidate)> = None;
    for c in found.iter().take(FINALISTS) {
        let Ok(img) = Image::open(source, &c.digest) else { continue };
        let equal = sample
            .iter()
            .filter(|(name, i, d)| img.files.iter().find(|f| &f.name == name).and_then(|f| f.chunks.get(*i as usize)).is_some_and(|r| &r.digest == d))
            .count();
        if best.is_none_or(|(n, _)| equal > n) {
            best = Some((equal, c));
        }
        if equal == sample.len() {
            break;
        }
    }
    let Some((equal, c)) = best else { return none(format!("no image of the same files in {} could be opened", dest.describe())) };
    if equal == 0 && !sample.is_empty() {
        return none(format!("the images of the same files in {} share none of {} sampled chunks", dest.describe(), sample.len()));
    }
    let how = if c.is_dest_tag {
        "the tag holds an image of the same files".to_string()
    } else if c.last_packed {
        format!("the image this directory was last pushed as, of the same files ({} tag(s) examined)", names.len())
    } else {
        format!("the newest image of the same files among {} tag(s) examined", names.len())
    };
    let why = if sample.is_empty() { how } else { format!("{how}, {equal} of {} sampled chunks equal", sample.len()) };
    Search { chosen: Some(Closest { tag: c.tag.clone(), digest: c.digest.clone(), why }), none_because: String::new() }
}

/// The creation time and manifest of the image `tag` names, when it is a snapshot of the
/// same files as `scan` (kind, chunking, file names); `None` for anything else (another
/// artifact, other files, or one that cannot be read).
fn same_files_candidate(source: &dyn BlobSource, tag: &str, scan: &DirScan, opts: &PackOptions) -> Option<(Option<time::OffsetDateTime>, OciDigest)> {
    let digest = source.resolve_tag(tag).ok()?;
    let m = imgfmt::source::read_verified_blob(source, &digest, imgfmt::manifest::MAX_MANIFEST_BYTES).ok().and_then(|b| Manifest::decode(&b).ok())?;
    if m.config.media_type != media::CONFIG {
        return None;
    }
    let c = imgfmt::source::read_verified_blob(source, &m.config.digest, imgfmt::config::MAX_CONFIG_BYTES).ok().and_then(|b| ImageConfig::decode(&b).ok())?;
    same_files_of_config(&c, c.files.iter().map(|f| f.name.as_str()), scan, opts).ok()?;
    let created = time::OffsetDateTime::parse(&c.created, &time::format_description::well_known::Rfc3339).ok();
    Some((created, digest))
}

/// Up to [`SAMPLE`] non-zero chunks of the directory, spread over its files: (file,
/// chunk number, digest in `opts.hash`). Unreadable chunks are left out.
fn sample_chunks(scan: &DirScan, opts: &PackOptions) -> Vec<(String, u64, ChunkDigest)> {
    let shift = opts.chunk_shift;
    let counts: Vec<u64> = scan.files.iter().map(|f| imgfmt::index::chunk_count(f.size, shift)).collect();
    let total: u64 = counts.iter().sum();
    let mut out = Vec::new();
    if total == 0 {
        return out;
    }
    let reads = (SAMPLE_READS as u64).min(total);
    let mut buf = Vec::new();
    for k in 0..reads {
        if out.len() == SAMPLE {
            break;
        }
        // Positions spread evenly over all chunks of all files.
        let mut at = k * total / reads;
        let Some((fi, n)) = counts.iter().enumerate().find_map(|(i, &n)| {
            if at < n {
                Some((i, n))
            } else {
                at -= n;
                None
            }
        }) else {
            break;
        };
        let f = &scan.files[fi];
        debug_assert!(at < n);
        buf.resize(imgfmt::index::chunk_len(f.size, shift, at) as usize, 0);
        let read = std::fs::File::open(&f.path).and_then(|file| file.read_exact_at(&mut buf, at << shift));
        if read.is_err() || verify::hash::is_zero(&buf) {
            continue;
        }
        out.push((f.name.clone(), at, verify::chunk_digest(opts.hash, &buf)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sample leaves out chunks of zeros (any two sparse images share those) and
    /// names each chunk it keeps by file, position and digest.
    #[test]
    fn the_sample_is_of_non_zero_chunks_with_their_positions() {
        let d = tempfile::tempdir().unwrap();
        let chunk = 64usize << 10;
        let mut mem = vec![0u8; 4 * chunk];
        mem[chunk..2 * chunk].fill(7);
        mem[3 * chunk + 5] = 1;
        std::fs::write(d.path().join("vm.mem"), &mem).unwrap();
        std::fs::write(d.path().join("vm.state"), vec![0u8; 100]).unwrap();
        let opts = PackOptions { chunk_shift: 16, ..Default::default() };
        let scan = DirScan::take(d.path()).unwrap();
        let sample = sample_chunks(&scan, &opts);
        let at: Vec<(&str, u64)> = sample.iter().map(|(n, i, _)| (n.as_str(), *i)).collect();
        assert_eq!(at, [("vm.mem", 1), ("vm.mem", 3)]);
        assert_eq!(sample[0].2, verify::chunk_digest(opts.hash, &mem[chunk..2 * chunk]));
        // An empty directory has no sample, and no error.
        let e = tempfile::tempdir().unwrap();
        assert!(sample_chunks(&DirScan::take(e.path()).unwrap(), &opts).is_empty());
    }
}
