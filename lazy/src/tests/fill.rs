//! The fill (spec/lazy.md "The fill"): a restore finishes its file into the chunk cache in
//! the background, pinned there, and then no longer needs its source.

use super::*;

/// Data chunks of the sample (every third chunk is zero).
fn data_chunks(image: &Image) -> Vec<usize> {
    let file = image.file("vm.mem").unwrap().0;
    image.files[file].chunks.iter().enumerate().filter(|(_, c)| !matches!(c.at, imgfmt::StoredAt::Zero)).map(|(i, _)| i).collect()
}

fn cached(cache: &puller::ChunkCache, image: &Image, c: usize) -> bool {
    let file = image.file("vm.mem").unwrap().0;
    cache.contains_unverified(image.config().hash, &image.files[file].chunks[c].digest)
}

/// Issue 35 §1: a guest touches three pages and keeps running (no stream starts); once
/// its faults settle, the daemon fills the rest of the file into the chunk cache (not into
/// guest memory), pinned: another process's `prune --all` leaves it. Then the source loses
/// the image's packs (a gc after the tag moved on), and every page the guest touches is
/// still right, served from the cache. Before, those touches were poisoned.
#[test]
fn regression_issue_35_the_fill_makes_a_restore_independent_of_its_source() {
    let (dir, mem, image, layout) = sample_image(48);
    let Some(guest) = Guest::new(&[(mem.len(), 0)]) else { return };
    let cache_dir = dir.path().join("cache");
    let cache = Arc::new(puller::ChunkCache::open(&cache_dir, puller::cache::DEFAULT_LIMIT).unwrap());
    let run = start_with_store(dir.path(), image.clone(), flaky(layout), Some(cache.clone()), |o| o.prefetch = PrefetchMode::None, None);
    let conn = guest.connect(&run.socket);
    let touched = [0usize, 2, 3];
    for c in touched {
        assert_eq!(guest.region(0)[c * K64 + 100], mem[c * K64 + 100]);
    }
    let t0 = Instant::now();
    wait_for("the fill is done", || metric(&run.daemon, "snapctl_lazy_fill_done") == 1);
    assert!(t0.elapsed() >= FILL_SETTLE, "the fill waited for the faults to settle: {:?}", t0.elapsed());
    let data = data_chunks(&image);
    assert!(data.iter().all(|&c| cached(&cache, &image, c)), "every data chunk is in the cache");
    assert_eq!(metric(&run.daemon, "snapctl_lazy_filled_chunks_total"), (data.len() - touched.len()) as u64, "the faults' chunks were there already");
    // Not installed: the untouched chunks' pages are still missing.
    let present = resident(guest.regions[0].0, mem.len());
    for &c in data.iter().filter(|c| !touched.contains(c)) {
        assert!(!present[c * 16..(c + 1) * 16].iter().any(|&p| p), "chunk {c} was installed into the guest");
    }
    // Pinned: another process's prune of everything not in use leaves them.
    let other = puller::ChunkCache::open(&cache_dir, puller::cache::DEFAULT_LIMIT).unwrap();
    other.prune(0).unwrap();
    assert!(data.iter().all(|&c| cached(&other, &image, c)), "a prune --all left the pinned chunks");
    // The registry's gc sweeps the image's packs.
    for p in &image.packs {
        std::fs::remove_file(dir.path().join("layout/blobs/sha256").join(p.digest.hex())).unwrap();
    }
    assert!(guest.region(0) == &mem[..], "every page right from the cache");
    drop(conn);
    let rep = run.reports.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!((rep.poisoned_pages, rep.verify_failures, rep.prefetched_chunks), (0, 0, 0), "{rep:?}");
    assert!(rep.fill.done && rep.fill.chunks == (data.len() - touched.len()) as u64, "{rep:?}");
    assert!(rep.faults.cache_hit > 0, "{rep:?}");
}

/// Issue 35 §1: the pinned chunks count toward the cache's budget and no eviction frees
/// them, so the fill stops where they would pass it (the rest keeps depending on the
/// source) and the cache stays within its budget.
#[test]
fn regression_issue_35_the_fill_stops_at_the_budget() {
    let (dir, mem, image, layout) = sample_image(48);
    let Some(guest) = Guest::new(&[(mem.len(), 0)]) else { return };
    let limit = 10 * K64 as u64 + 4096;
    let cache = Arc::new(puller::ChunkCache::open(&dir.path().join("cache"), limit).unwrap());
    let run = start_with_store(dir.path(), image.clone(), flaky(layout), Some(cache.clone()), |o| o.prefetch = PrefetchMode::None, None);
    let conn = guest.connect(&run.socket);
    assert_eq!(guest.region(0)[100], mem[100]);
    wait_for("the fill stops", || metric(&run.daemon, "snapctl_lazy_filled_chunks_total") >= 9);
    std::thread::sleep(Duration::from_millis(500));
    let held = data_chunks(&image).into_iter().filter(|&c| cached(&cache, &image, c)).count();
    assert_eq!(held, 10, "the budget's worth of chunks");
    assert_eq!(metric(&run.daemon, "snapctl_lazy_fill_done"), 0);
    assert!(cache.usage().unwrap().total_bytes <= limit);
    drop(conn);
    let rep = run.reports.recv_timeout(Duration::from_secs(10)).unwrap();
    assert!(!rep.fill.done, "{rep:?}");
}

/// `fill` off: nothing goes into the cache but what the guest's faults fetched.
#[test]
fn with_the_fill_off_only_the_faults_chunks_are_cached() {
    let (dir, mem, image, layout) = sample_image(12);
    let Some(guest) = Guest::new(&[(mem.len(), 0)]) else { return };
    let cache = Arc::new(puller::ChunkCache::open(&dir.path().join("cache"), puller::cache::DEFAULT_LIMIT).unwrap());
    let run = start_with_store(
        dir.path(),
        image.clone(),
        flaky(layout),
        Some(cache.clone()),
        |o| {
            o.prefetch = PrefetchMode::None;
            o.fill = false;
        },
        None,
    );
    let conn = guest.connect(&run.socket);
    assert_eq!(guest.region(0)[100], mem[100]);
    std::thread::sleep(FILL_SETTLE + Duration::from_millis(1500));
    drop(conn);
    let rep = run.reports.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!((rep.fill.chunks, rep.fill.done), (0, false), "{rep:?}");
    let held = data_chunks(&image).into_iter().filter(|&c| cached(&cache, &image, c)).count();
    assert_eq!(held, 1, "the touched chunk only");
}
