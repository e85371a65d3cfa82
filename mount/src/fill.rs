//! The background fill: every stored chunk of an image into the host's chunk cache, so
//! the kernel can drop its page cache and a later read, or the next mount, costs no
//! fetch.
//!
//! ```text
//! order: the memory file's recorded trace (`--prefetch trace`, when there is one),
//!        then every file's stored chunks in file order (`trace` and `all`); `none`: no fill
//! each chunk: skipped when the cache has it; else fetched through the image's chunk
//!             source (single-flight with the readers: a chunk a reader is fetching is
//!             waited for, not fetched twice) and queued for the cache
//! yielding: while reads are being answered, the fill waits (up to 50 ms at a time)
//! ```

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Weak};
use std::time::Duration;

use imgfmt::{Image, StoredAt};
use lazy::{PrefetchMode, Trace};

use crate::Served;

/// How long the fill waits at a time while readers are being answered.
const YIELD: Duration = Duration::from_millis(50);

/// The fill's order: `(file, chunk)` of every stored chunk, the trace's first; and how
/// many came from the trace.
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
    for (f, file) in image.files.iter().enumerate() {
        for (c, ch) in file.chunks.iter().enumerate() {
            if !seen[f][c] && ch.at != StoredAt::Zero {
                out.push((f, c as u64));
            }
        }
    }
    (out, traced)
}

/// Fill the cache with `order`'s chunks of `served` until done, `stop`, or the image is
/// no longer presented (nothing else holds it: its pin goes with it), yielding while
/// `active` reads are being answered. A chunk that cannot be had is logged and skipped (a
/// reader that needs it gets its own verdict).
pub fn run(served: &Weak<Served>, order: &[(usize, u64)], active: &AtomicU64, stop: &AtomicBool) {
    for &(file, chunk) in order {
        while active.load(Relaxed) > 0 && !stop.load(Relaxed) {
            std::thread::sleep(YIELD);
        }
        let Some(served) = served.upgrade().filter(|_| !stop.load(Relaxed)) else { return };
        if let Err(e) = served.chunks.fill(file, chunk) {
            tracing::warn!("{}: fill: {e}", served.name);
        }
    }
    if let Some(served) = served.upgrade() {
        tracing::info!("{}: fill done: {} chunks", served.name, order.len());
    }
}

/// [`run`] on a thread of its own.
pub fn spawn(served: Arc<Served>, order: Vec<(usize, u64)>, active: Arc<AtomicU64>, stop: Arc<AtomicBool>) {
    if order.is_empty() {
        return;
    }
    let (name, served) = (served.name.clone(), Arc::downgrade(&served));
    if let Err(e) = std::thread::Builder::new().name("mount-fill".into()).spawn(move || run(&served, &order, &active, &stop)) {
        tracing::warn!("{name}: no fill (cannot start its thread: {e})");
    }
}
