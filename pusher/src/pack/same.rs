//! Whether an image holds "the same files" as a directory, so a new image of it is a layer over it.

use imgfmt::{HashAlgo, Image, ImageConfig, Kind};

use crate::scan;

use super::options::PackOptions;

/// Why the image a tag holds is not taken, by itself, as the parent of a new image of a
/// directory (spec/transfer.md §2, "The tag's image as the parent").
#[derive(Debug, thiserror::Error, displaydoc::Display)]
#[non_exhaustive]
pub enum NotSameFiles {
    /// it is a {image} snapshot and this directory a {dir} one
    Kind { image: Kind, dir: Kind },
    /// it is cut into {image_chunk} KiB chunks hashed with {image_hash}, this pack {chunk} KiB with {hash} (pass the same --chunk-size and --hash)
    Chunking { image_chunk: u64, image_hash: HashAlgo, chunk: u64, hash: HashAlgo },
    /// not the same files (only in the directory: {added}; only in the image: {removed})
    Files { added: String, removed: String },
}

/// Whether `image` holds a snapshot of "the same files" as the directory `scan` lists,
/// packed with `opts`, so that a new image of the directory is made as a layer over it
/// without being asked: the same kind, chunk size and hash, and the same set of file
/// names (sizes and content may differ; that is what a layer records).
pub fn same_files(image: &Image, scan: &scan::DirScan, opts: &PackOptions) -> Result<(), NotSameFiles> {
    same_files_of_config(image.config(), image.files.iter().map(|f| f.name.as_str()), scan, opts)
}

/// [`same_files`] of an image's config `c` (its file names `names`): what a push checks of
/// each image of a repository before opening any.
pub fn same_files_of_config<'a>(c: &ImageConfig, names: impl Iterator<Item = &'a str>, sc: &scan::DirScan, opts: &PackOptions) -> Result<(), NotSameFiles> {
    if c.hash != opts.hash || c.chunk_shift() != opts.chunk_shift {
        return Err(NotSameFiles::Chunking { image_chunk: c.chunk_size >> 10, image_hash: c.hash, chunk: (1u64 << opts.chunk_shift) >> 10, hash: opts.hash });
    }
    let kind = opts.kind.unwrap_or_else(|| scan::detect_kind(&sc.files));
    if c.kind != kind {
        return Err(NotSameFiles::Kind { image: c.kind, dir: kind });
    }
    let ours: std::collections::BTreeSet<&str> = sc.files.iter().map(|f| f.name.as_str()).collect();
    let theirs: std::collections::BTreeSet<&str> = names.collect();
    if ours != theirs {
        // A few names are enough to say why; a directory of thousands is not listed whole.
        let list = |v: Vec<&&str>| {
            let mut s = v.iter().take(5).map(|n| n.to_string()).collect::<Vec<_>>().join(", ");
            if v.len() > 5 {
                s.push_str(&format!(" and {} more", v.len() - 5));
            }
            if s.is_empty() {
                s.push_str("none");
            }
            s
        };
        return Err(NotSameFiles::Files { added: list(ours.difference(&theirs).collect()), removed: list(theirs.difference(&ours).collect()) });
    }
    Ok(())
}
