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
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let first_err: Mutex<Option<E>> = Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..threads.clamp(1, n.max(1)) {
            s.spawn(|| {
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
            });
        }
    });
    match first_err.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// [`try_for_each_index`] for work that cannot fail.
pub fn for_each_index<S>(n: usize, threads: usize, init: impl Fn() -> S + Sync, f: impl Fn(&mut S, usize) + Sync) {
    let _ = try_for_each_index::<S, std::convert::Infallible>(n, threads, init, |s, i| {
        f(s, i);
        Ok(())
    });
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
