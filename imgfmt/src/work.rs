//! One worker pool for the crates above: items `0..n` shared out to a few scoped
//! threads, each taking the next index as it finishes one (chunks and blobs differ in
//! cost), the first error stopping the rest.
//!
//! ```text
//! next: AtomicUsize ──► thread 1: f(state, 0) f(state, 3) ...
//!                   ├─► thread 2: f(state, 1) f(state, 4) ...   first Err ──► stop flag
//!                   └─► thread k: f(state, 2) ...                          └─► returned
//! ```
//! Items already started when an error happens finish; no new one starts.
//!
//! Two variants share that loop: [`try_for_each_index_growing`], whose caller may add
//! threads while the items run (a pull sizes its requests in flight once it has timed a
//! round trip), and [`for_each_mut`], over the items of a slice rather than indices.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::Mutex;

/// Run `f(&mut state, i)` for every `i < n` on up to `threads` threads (at least one, at
/// most `n`), `state` made once per thread by `init` (a scratch buffer). Returns the
/// first error; after it no new index is taken.
pub fn try_for_each_index<S, E: Send>(
    n: usize,
    threads: usize,
    init: impl Fn() -> S + Sync,
    f: impl Fn(&mut S, usize) -> Result<(), E> + Sync,
) -> Result<(), E> {
    try_for_each_index_growing(n, threads, init, f, |_| ()).0
}

/// The pool of [`try_for_each_index_growing`] as its caller sees it while it runs.
pub struct Growing<'a> {
    next: &'a AtomicUsize,
    stop: &'a AtomicBool,
    add: &'a dyn Fn() -> bool,
}

impl Growing<'_> {
    /// Indices taken so far: items started, done, or (past `n`) none left.
    pub fn taken(&self) -> usize {
        self.next.load(Relaxed)
    }

    /// Whether an item failed (no new index is taken).
    pub fn stopped(&self) -> bool {
        self.stop.load(Relaxed)
    }

    /// Start one more thread on the remaining items; `false` if the system has none to
    /// give (the threads running finish the work).
    pub fn add_thread(&self) -> bool {
        (self.add)()
    }
}

/// [`try_for_each_index`] that also runs `meanwhile` on the calling thread once the first
/// `threads` are started: it may add threads ([`Growing::add_thread`]) as it learns what
/// the work needs. Returns the first error and what `meanwhile` returned, once every
/// item is done.
pub fn try_for_each_index_growing<S, E: Send, R>(
    n: usize,
    threads: usize,
    init: impl Fn() -> S + Sync,
    f: impl Fn(&mut S, usize) -> Result<(), E> + Sync,
    meanwhile: impl FnOnce(&Growing<'_>) -> R,
) -> (Result<(), E>, R) {
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let first_err: Mutex<Option<E>> = Mutex::new(None);
    // Only shared references: the closure is `Copy`, one per thread.
    let worker = || {
        let mut state = init();
        while !stop.load(Relaxed) {
            let i = next.fetch_add(1, Relaxed);
            if i >= n {
                return;
            }
            if let Err(e) = f(&mut state, i) {
                stop.store(true, Relaxed);
                first_err.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e);
                return;
            }
        }
    };
    let r = std::thread::scope(|s| {
        for _ in 0..threads.clamp(1, n.max(1)) {
            s.spawn(worker);
        }
        let add = || std::thread::Builder::new().spawn_scoped(s, worker).is_ok();
        meanwhile(&Growing { next: &next, stop: &stop, add: &add })
    });
    match first_err.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => (Err(e), r),
        None => (Ok(()), r),
    }
}

/// [`try_for_each_index`] for work that cannot fail.
pub fn for_each_index<S>(n: usize, threads: usize, init: impl Fn() -> S + Sync, f: impl Fn(&mut S, usize) + Sync) {
    let _ = try_for_each_index::<S, std::convert::Infallible>(n, threads, init, |s, i| {
        f(s, i);
        Ok(())
    });
}

/// Run `f` on every item of `items` on up to `threads` threads, each taking the next item
/// as it finishes one (for work that fills in items in place: a batch of chunks hashed).
pub fn for_each_mut<T: Send>(items: &mut [T], threads: usize, f: impl Fn(&mut T) + Sync) {
    let n = items.len();
    // One item handed out per index taken, so the two counts end together.
    let items = Mutex::new(items.iter_mut());
    for_each_index(
        n,
        threads,
        || (),
        |_, _| {
            let item = items.lock().unwrap_or_else(|p| p.into_inner()).next();
            f(item.expect("an item for every index"));
        },
    );
}

/// `first`, then whatever `rx` already holds, up to `max` items in all, without waiting:
/// a batch for a writer that blocks for one item, so batches grow only while the writer
/// (the disk) is the bottleneck and a slow trickle goes down at once.
pub fn batch_after<T>(first: T, rx: &std::sync::mpsc::Receiver<T>, max: usize) -> Vec<T> {
    let mut batch = vec![first];
    while batch.len() < max {
        match rx.try_recv() {
            Ok(x) => batch.push(x),
            Err(_) => break,
        }
    }
    batch
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    #[test]
    fn every_index_runs_once() {
        let seen: Vec<AtomicU64> = (0..1000).map(|_| AtomicU64::new(0)).collect();
        for_each_index(
            seen.len(),
            4,
            || (),
            |_, i| {
                seen[i].fetch_add(1, Relaxed);
            },
        );
        assert!(seen.iter().all(|c| c.load(Relaxed) == 1));
        for_each_index(0, 4, || (), |_, _| unreachable!("no items"));
    }

    #[test]
    fn the_first_error_stops_new_items_and_is_returned() {
        let ran = AtomicU64::new(0);
        let r = try_for_each_index(
            10_000,
            3,
            || (),
            |_, i| {
                ran.fetch_add(1, Relaxed);
                if i == 5 {
                    Err(format!("item {i}"))
                } else {
                    Ok(())
                }
            },
        );
        assert_eq!(r.unwrap_err(), "item 5");
        assert!(ran.load(Relaxed) < 10_000, "items after the error were not started");
    }

    #[test]
    fn threads_added_while_running_share_the_items() {
        let seen: Vec<AtomicU64> = (0..400).map(|_| AtomicU64::new(0)).collect();
        let threads = Mutex::new(std::collections::HashSet::new());
        let (r, added) = try_for_each_index_growing::<_, (), _>(
            seen.len(),
            1,
            || (),
            |_, i| {
                threads.lock().unwrap().insert(std::thread::current().id());
                seen[i].fetch_add(1, Relaxed);
                // Slow enough that the added threads find items left.
                std::thread::sleep(std::time::Duration::from_millis(1));
                Ok(())
            },
            |pool| (0..3).filter(|_| pool.taken() < 200 && pool.add_thread()).count(),
        );
        r.unwrap();
        assert_eq!(added, 3);
        assert!(seen.iter().all(|c| c.load(Relaxed) == 1), "every index once");
        assert_eq!(threads.into_inner().unwrap().len(), 4, "the added threads took items");
    }

    #[test]
    fn a_growing_pool_stops_at_the_first_error() {
        let (r, stopped) = try_for_each_index_growing(
            1_000_000,
            2,
            || (),
            |_, i| if i == 3 { Err(i) } else { Ok(()) },
            |pool| {
                while !pool.stopped() {
                    std::thread::yield_now();
                }
                pool.taken()
            },
        );
        assert_eq!(r.unwrap_err(), 3);
        assert!(stopped < 1_000_000);
    }

    #[test]
    fn every_item_is_visited_once_in_place() {
        let mut items: Vec<(usize, u32)> = (0..1000).map(|i| (i, 0)).collect();
        for_each_mut(&mut items, 4, |(i, n)| *n += *i as u32 + 1);
        assert!(items.iter().all(|&(i, n)| n == i as u32 + 1));
        for_each_mut(&mut Vec::<u8>::new(), 4, |_| unreachable!("no items"));
    }

    #[test]
    fn state_is_per_thread() {
        let threads = Mutex::new(Vec::new());
        for_each_index(
            100,
            2,
            || std::thread::current().id(),
            |id, _| {
                assert_eq!(*id, std::thread::current().id());
                threads.lock().unwrap().push(*id);
            },
        );
        assert_eq!(threads.into_inner().unwrap().len(), 100);
    }
}
