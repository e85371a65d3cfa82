//! Stopping the page server on a signal.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;

use crate::cmd::common;

/// On the first SIGTERM or SIGINT, `drain` (from a thread of its own); on a second, exit at
/// once with status 2. Stopping a page server while a guest still faults would let the
/// kernel zero-fill that guest's untouched memory, so the first signal only stops taking
/// new work.
pub fn on_terminate(drain: impl Fn() + Send + 'static) -> anyhow::Result<()> {
    let hit = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        // Registered first, so it sees the flag as it was before this signal set it.
        signal_hook::flag::register_conditional_shutdown(sig, common::EXIT_ERROR as i32, hit.clone()).context("installing a signal handler")?;
        signal_hook::flag::register(sig, hit.clone()).context("installing a signal handler")?;
    }
    std::thread::Builder::new()
        .name("lazy-signals".into())
        .spawn(move || {
            while !hit.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(50));
            }
            drain();
        })
        .context("spawning the signal thread")?;
    Ok(())
}
