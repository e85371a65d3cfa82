//! The bytes of a read: a range of a file made from the verified chunks under it.
//!
//! ```text
//! (content, offset, len) -> clipped to the file's size (short only at its end)
//!   File / BaseFile: each chunk under the range (zeros from the zero map, nothing
//!                    fetched; stored ones verified) -> copied in
//!   Pages:   the image's bytes, zeroed where a 4 KiB page equals the base's (a chunk
//!            whose digest is the base's at the same place: zeros, nothing fetched)
//!   PageMap: a bit per page, set where the page differs (same rule)
//! ```
//!
//! Every chunk under a range must come whole and verified, or the read fails as a whole
//! with the first chunk's failure: no byte of a chunk that failed is ever handed out.

use imgfmt::StoredAt;

use crate::chunks::{ChunkFailure, ChunkSource, Need};
use crate::tree::{Content, PAGE};
use crate::Served;

/// Bytes `offset .. offset + len` of a file of `size` bytes whose bytes are `content`
/// of `served`, clipped to the file: full length but at its end.
pub fn read(served: &Served, content: Content, size: u64, offset: u64, len: u32, need: Need) -> Result<Vec<u8>, ChunkFailure> {
    let end = size.min(offset.saturating_add(u64::from(len)));
    if offset >= end {
        return Ok(Vec::new());
    }
    let mut out = vec![0u8; (end - offset) as usize];
    match content {
        Content::File { file } => read_file(served.chunks.as_ref(), file, offset, &mut out, need)?,
        Content::BaseFile { file } => read_file(base_of(served), file, offset, &mut out, need)?,
        Content::Pages { file, base_file } => read_pages(served, file, base_file, offset, &mut out, need)?,
        Content::PageMap { file, base_file } => read_map(served, file, base_file, offset, &mut out, need)?,
    }
    Ok(out)
}

fn base_of(served: &Served) -> &dyn ChunkSource {
    served.base.as_deref().expect("a clone view has a base")
}

/// Fill `out` with file `file`'s bytes from `offset` (within the file).
pub fn read_file(src: &dyn ChunkSource, file: usize, offset: u64, out: &mut [u8], need: Need) -> Result<(), ChunkFailure> {
    let shift = src.image().chunk_shift();
    let mut done = 0usize;
    while done < out.len() {
        let at = offset + done as u64;
        let chunk = at >> shift;
        let within = (at - (chunk << shift)) as usize;
        let len = src.image().files[file].chunks[chunk as usize].len as usize;
        let n = (len - within).min(out.len() - done);
        src.read_part(file, chunk, within, &mut out[done..done + n], need)?;
        done += n;
    }
    Ok(())
}

/// Whether chunk `c` of the image's file equals the base's chunk at the same place, by
/// digest (same chunk size and length): then its pages are the base's, nothing fetched.
fn same_as_base(served: &Served, file: usize, base_file: usize, c: u64) -> bool {
    let (img, base) = (served.chunks.image(), base_of(served).image());
    if img.chunk_shift() != base.chunk_shift() || img.config().hash != base.config().hash {
        return false;
    }
    let (a, b) = (img.files[file].chunks.get(c as usize), base.files[base_file].chunks.get(c as usize));
    matches!((a, b), (Some(a), Some(b)) if a.digest == b.digest && a.len == b.len) || matches!((a, b), (Some(a), None) if a.at == StoredAt::Zero)
}

/// For each 4 KiB page from `first_page` covering `len_pages` pages of the image's file:
/// whether it differs from the base's page (`None`: the bytes were not needed).
fn differing_pages(
    served: &Served,
    file: usize,
    base_file: usize,
    first_page: u64,
    pages: u64,
    need: Need,
    mut each: impl FnMut(u64, Option<&[u8]>),
) -> Result<(), ChunkFailure> {
    let img = served.chunks.image();
    let size = img.files[file].size;
    let base_size = base_of(served).image().files[base_file].size;
    let shift = img.chunk_shift();
    let mut page = first_page;
    while page < first_page + pages {
        let at = page * PAGE;
        let c = at >> shift;
        let chunk_end = ((c + 1) << shift).min(size);
        let last = (chunk_end.div_ceil(PAGE)).min(first_page + pages);
        if same_as_base(served, file, base_file, c) {
            (page..last).for_each(|p| each(p, None));
            page = last;
            continue;
        }
        let from = page * PAGE;
        let to = (last * PAGE).min(size);
        let mut mine = vec![0u8; (to - from) as usize];
        read_file(served.chunks.as_ref(), file, from, &mut mine, need)?;
        let mut theirs = vec![0u8; mine.len()];
        let base_to = to.min(base_size);
        if base_to > from {
            read_file(base_of(served), base_file, from, &mut theirs[..(base_to - from) as usize], need)?;
        }
        for (i, p) in (page..last).enumerate() {
            let r = i * PAGE as usize..((i + 1) * PAGE as usize).min(mine.len());
            each(p, (mine[r.clone()] != theirs[r.clone()]).then(|| &mine[r]));
        }
        page = last;
    }
    Ok(())
}

/// `NAME.pages`: the image's bytes where its page differs from the base's, zeros elsewhere.
fn read_pages(served: &Served, file: usize, base_file: usize, offset: u64, out: &mut [u8], need: Need) -> Result<(), ChunkFailure> {
    let first = offset / PAGE;
    let pages = (offset + out.len() as u64).div_ceil(PAGE) - first;
    differing_pages(served, file, base_file, first, pages, need, |p, bytes| {
        let Some(bytes) = bytes else { return };
        // The part of page `p` inside the read.
        let (pstart, pend) = (p * PAGE, p * PAGE + bytes.len() as u64);
        let (s, e) = (pstart.max(offset), pend.min(offset + out.len() as u64));
        if s < e {
            out[(s - offset) as usize..(e - offset) as usize].copy_from_slice(&bytes[(s - pstart) as usize..(e - pstart) as usize]);
        }
    })
}

/// `NAME.pagemap`: bit `p % 8` (least significant first) of byte `p / 8` is set where page
/// `p` of the image's file differs from the base's.
fn read_map(served: &Served, file: usize, base_file: usize, offset: u64, out: &mut [u8], need: Need) -> Result<(), ChunkFailure> {
    let total = served.chunks.image().files[file].size.div_ceil(PAGE);
    let first = offset * 8;
    let pages = (out.len() as u64 * 8).min(total.saturating_sub(first));
    differing_pages(served, file, base_file, first, pages, need, |p, bytes| {
        if bytes.is_some() {
            let bit = p - first;
            out[(bit / 8) as usize] |= 1 << (bit % 8);
        }
    })
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileExt;
    use std::sync::Arc;

    use imgfmt::{BlobSource, Image, OciLayout, RetryPolicy};

    use super::*;
    use crate::{Fetcher, Served};

    fn open(layout: &OciLayout, tag: &str) -> Image {
        Image::open(layout, &layout.resolve_tag(tag).unwrap()).unwrap()
    }

    /// spec/mount.md §4's worked example: a 16 MiB base and a clone that rewrote pages 1,
    /// 2 and 700.
    #[test]
    fn the_clone_layout_matches_the_spec_worked_example() {
        let t = tempfile::tempdir().unwrap();
        let (base_dir, clone_dir) = (t.path().join("base"), t.path().join("clone"));
        std::fs::create_dir_all(&base_dir).unwrap();
        let mut mem = vec![0u8; 16 << 20];
        for (i, b) in mem.iter_mut().enumerate() {
            *b = (i * 7 + i / 4096) as u8;
        }
        std::fs::write(base_dir.join("vm.mem"), &mem).unwrap();
        std::fs::create_dir_all(&clone_dir).unwrap();
        std::fs::write(clone_dir.join("vm.mem"), &mem).unwrap();
        let f = std::fs::OpenOptions::new().write(true).open(clone_dir.join("vm.mem")).unwrap();
        for p in [1u64, 2, 700] {
            f.write_all_at(&[0xee; 4096], p * 4096).unwrap();
        }
        let layout = OciLayout::open_or_create(t.path().join("l")).unwrap();
        pusher::pack(&base_dir, &layout, "base", &Default::default()).unwrap();
        let base = pusher::Related { source: &layout, image: open(&layout, "base"), reference: "base".into() };
        pusher::pack(&clone_dir, &layout, "clone", &pusher::PackOptions { base: Some(base), ..Default::default() }).unwrap();

        let src: Arc<dyn BlobSource> = Arc::new(OciLayout::open(t.path().join("l")).unwrap());
        let fetcher = |i: Image| -> Arc<dyn ChunkSource> { Fetcher::new(Arc::new(i), src.clone(), None, RetryPolicy::never(), 64 << 20) };
        let served = Served {
            name: "clone".into(),
            reference: "clone".into(),
            chunks: fetcher(open(&layout, "clone")),
            base: Some(fetcher(open(&layout, "base"))),
            counters: Default::default(),
            added: std::time::Instant::now(),
        };
        let map = read(&served, Content::PageMap { file: 0, base_file: 0 }, 512, 0, 4096, Need::Read).unwrap();
        assert_eq!(map.len(), 512);
        let set: Vec<(usize, u8)> = map.iter().copied().enumerate().filter(|(_, b)| *b != 0).collect();
        assert_eq!(set, vec![(0, 0x06), (87, 0x10)]);
        assert_eq!(served.chunks.counters().fetched_chunks.load(std::sync::atomic::Ordering::Relaxed), 2, "chunks 0 and 2 only");

        let pages = read(&served, Content::Pages { file: 0, base_file: 0 }, 16 << 20, 0, 3 << 20, Need::Read).unwrap();
        let own = |r: std::ops::Range<usize>| pages[r].iter().all(|&b| b == 0xee);
        assert!(own(4096..12288) && own(2867200..2871296));
        assert!(pages[..4096].iter().chain(&pages[12288..2867200]).chain(&pages[2871296..]).all(|&b| b == 0), "zeros elsewhere");
    }
}
