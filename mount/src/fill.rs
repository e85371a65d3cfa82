//! The background fill: every stored chunk of an image into the host's chunk cache, so
//! the kernel can drop its page cache and a later read, or the next mount, costs no
//! fetch.
//!
//! ```text
//! order: the memory file's recorded trace (`--prefetch trace`, when there is one),
//!        then every file's stored chunks in file order, the small files a runtime reads
//!        first (state, metadata) before the bulk ones (memory, pages) (`trace` and
//!        `all`); `none`: no fill
//! each chunk: skipped when the cache has it; else fetched through the image's chunk
//!             source (single-flight with the readers: a chunk a reader is fetching is
//!             waited for, not fetched twice) and queued for the cache
//! pacing: FILL_JOBS workers take chunks in order; each fetch waits for room in the
//!         source's window (lazy's scavenger pacer: readers' fetches count against it
//!         first, their slice fetches and a probe thread measure the queueing delay)
//! ```

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::Weak;

use imgfmt::{Image, Role, StoredAt};
use lazy::{PrefetchMode, Trace};

use crate::chunks::FILL_JOBS;
use crate::Served;

/// The fill's order: `(file, chunk)` of every stored chunk, the trace's first, then the
/// files' in file order, those of role memory or pages last (a runtime reads the state
/// and the maps before it reads memory: gVisor's `checkpoint.img` and `pages_meta.img`
/// before `pages.img`); and how many came from the trace.
pub fn order(image: &Image, mode: PrefetchMode, trace: Option<(usize, &Trace)>) -> (Vec<(usize, u64)>, usize) {
    if mode == PrefetchMode::None {
        return (Vec::new(), 0);
    }
    let mut seen: Vec<Vec<bool>> = image.files.iter().map(|f| vec![false; f.chunks.len()]).collect();
    let mut out = Vec::new();
    if let Some((file, t)) = trace.filter(|_| mode == PrefetchMode::Trace) {
        for c in lazy::prefetch::prefetch_order(PrefetchMode::Trace, Some(t), image, file) {
            seen[file][c as usize] = true;
            out.push((file, c));
        }
    }
    let traced = out.len();
    let mut files: Vec<_> = image.files.iter().enumerate().collect();
    files.sort_by_key(|(_, f)| matches!(f.role, Role::Memory | Role::Pages));
    for (f, file) in files {
        for (c, ch) in file.chunks.iter().enumerate() {
            if !seen[f][c] && ch.at != StoredAt::Zero {
                out.push((f, c as u64));
            }
        }
    }
    (out, traced)
}

/// Fill the cache with `order`'s chunks of `served` until done, `stop`, or the image is
/// no longer presented (nothing else holds it: its pin goes with it): [`FILL_JOBS`]
/// workers, each fetch paced by the source's window, with a probe thread timing the
/// source while they run. A chunk that cannot be had is logged and skipped (a reader that
/// needs it gets its own verdict).
pub fn run(served: &Weak<Served>, order: &[(usize, u64)], stop: &AtomicBool) {
    let Some(first) = served.upgrade() else { return };
    let pacing = first.chunks.pacing().map(|(bg, src)| (bg.clone(), src.clone()));
    let probe_blob = first.chunks.image().packs.first().map(|p| p.digest.clone());
    drop(first);
    let ended = || stop.load(Relaxed) || served.strong_count() == 0;
    let next = AtomicUsize::new(0);
    let probes_done = AtomicBool::new(false);
    std::thread::scope(|s| {
        let _wanting = pacing.as_ref().map(|(bg, _)| bg.wanting());
        if let (Some((bg, src)), Some(blob)) = (&pacing, &probe_blob) {
            let done = &probes_done;
            s.spawn(move || bg.probe(src.as_ref(), blob, done));
        }
        let workers: Vec<_> = (0..FILL_JOBS)
            .map(|_| {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, Relaxed);
                    let Some(&(file, chunk)) = order.get(i) else { return };
                    let Some(served) = served.upgrade().filter(|_| !ended()) else { return };
                    if let Err(e) = served.chunks.fill_paced(file, chunk, &ended) {
                        tracing::warn!("{}: fill: {e}", served.name);
                    }
                })
            })
            .collect();
        for w in workers {
            let _ = w.join();
        }
        probes_done.store(true, Relaxed);
    });
    if let Some(served) = served.upgrade().filter(|_| !stop.load(Relaxed)) {
        let cuts = pacing.as_ref().map_or(0, |(bg, _)| bg.report().cuts);
        tracing::info!("{}: fill done: {} chunks (pacing: {cuts} cuts)", served.name, order.len());
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use std::sync::Arc;

    use imgfmt::{BlobSource, RetryPolicy};
    use puller::ChunkCache;

    use super::*;
    use crate::Fetcher;

    #[test]
    fn regression_issue_38_the_fill_takes_the_state_before_the_memory() {
        let t = tempfile::tempdir().unwrap();
        let src = t.path().join("src");
        std::fs::create_dir_all(&src).unwrap();
        std::fs::write(src.join("vm.mem"), vec![3u8; 3 << 20]).unwrap();
        std::fs::write(src.join("vm.state"), vec![5u8; 5000]).unwrap();
        let layout = imgfmt::OciLayout::open_or_create(t.path().join("l")).unwrap();
        pusher::pack(&src, &layout, "v1", &Default::default()).unwrap();
        let image = Image::open(&layout, &layout.resolve_tag("v1").unwrap()).unwrap();
        let names: Vec<_> = image.files.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, ["vm.mem", "vm.state"], "the memory file comes first in file order");
        let (order, traced) = order(&image, PrefetchMode::All, None);
        assert_eq!(traced, 0);
        let files: Vec<_> = order.iter().map(|&(f, _)| image.files[f].name.as_str()).collect();
        assert_eq!(files, ["vm.state", "vm.mem", "vm.mem", "vm.mem"], "the state is filled first");
    }

    #[test]
    fn regression_issue_37_the_mount_fill_takes_every_chunk_through_the_pacing_window() {
        let t = tempfile::tempdir().unwrap();
        let (layout, image, _) = crate::chunks::tests::packed_mib(t.path(), 6);
        let src: Arc<dyn BlobSource> = layout;
        let cache = Arc::new(ChunkCache::open(&t.path().join("cache"), 1 << 30).unwrap());
        let served = Arc::new(Served {
            name: "img".into(),
            reference: "img".into(),
            chunks: Fetcher::new(image.clone(), src, Some(cache.clone()), RetryPolicy::never(), 64 << 20),
            base: None,
            counters: Default::default(),
            added: Instant::now(),
        });
        let (order, _) = order(&image, PrefetchMode::All, None);
        assert_eq!(order.len(), 6);
        run(&Arc::downgrade(&served), &order, &AtomicBool::new(false));
        let (bg, _) = served.chunks.pacing().expect("paced");
        let r = bg.report();
        assert!(r.most_bytes > 0 && r.most_bytes <= (FILL_JOBS as u64) << 20, "every fetch held room in the window: {r:?}");
        assert_eq!(served.chunks.counters().filled_chunks.load(Relaxed), 6);
        drop(served);
        let algo = image.config().hash;
        for c in &image.files[0].chunks {
            assert!(cache.contains_unverified(algo, &c.digest), "every chunk in the cache");
        }
    }
}
