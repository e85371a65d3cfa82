//! One retry policy for everything that reads a [`crate::BlobSource`] over a network: the
//! registry client's requests, a pull's range requests, the lazy server's chunk fetches.
//!
//! Callers decide *what* is worth retrying (only errors whose kind
//! [`crate::ErrorKind::is_transient`]; integrity failures have their own "fetch once
//! more, then fail" rules), and ask the policy *how long to wait*, or whether to give up:
//!
//! ```text
//! failure n ──► RetryPolicy::next_wait(n, elapsed, Retry-After) ──► Some(wait): sleep, try again
//!                                                               └─► None: give up
//! wait = min(first_backoff · 2^(n-1), max_backoff) · (1 + jitter · U[0,1))
//!        or the source's Retry-After when longer (capped at max_retry_after, no jitter)
//! give up when n > max_retries, or when elapsed + wait would pass the budget
//! ```

use std::time::{Duration, Instant};

/// When to try again after a transient failure, and when to give up.
///
/// A policy caps the retries (`max_retries`), the time spent (`budget`), or both; the lazy
/// server's "stall, never fail" is a budget with no cap on retries. Jitter spreads retries
/// of parallel requests that failed together, so they do not all come back at once.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryPolicy {
    /// Retries after the first try (`None`: no cap; `Some(0)`: never retry).
    pub max_retries: Option<u32>,
    /// Give up once retrying would take longer than this since the first failure (`None`:
    /// no limit).
    pub budget: Option<Duration>,
    /// Wait before the first retry; it doubles with each further failure.
    pub first_backoff: Duration,
    /// Longest wait between two tries, before jitter.
    pub max_backoff: Duration,
    /// Up to this fraction of the wait is added at random (0.5: +0..50 %).
    pub jitter: f64,
    /// Longest `Retry-After` honoured; a source asking for more waits this long.
    pub max_retry_after: Duration,
}

impl RetryPolicy {
    /// `retries` retries, 200 ms doubling to 5 s, +0..50 % jitter: a registry request (5
    /// retries, [`RetryPolicy::default`]) or a pull's range request (4).
    pub const fn attempts(retries: u32) -> Self {
        RetryPolicy {
            max_retries: Some(retries),
            budget: None,
            first_backoff: Duration::from_millis(200),
            max_backoff: Duration::from_secs(5),
            jitter: 0.5,
            max_retry_after: Duration::from_secs(60),
        }
    }

    /// Retry for as long as `budget` allows, however many tries that takes: 50 ms doubling
    /// to 5 s. The lazy server's policy: a faulting vCPU that waits recovers when the
    /// registry does; one whose page is poisoned does not.
    pub const fn stall(budget: Duration) -> Self {
        RetryPolicy {
            max_retries: None,
            budget: Some(budget),
            first_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_secs(5),
            jitter: 0.5,
            max_retry_after: Duration::from_secs(60),
        }
    }

    /// Never retry: the first failure is the answer (a caller that retries itself).
    pub const fn never() -> Self {
        RetryPolicy::attempts(0)
    }

    /// The wait before retry `failures` (1 for the first), without jitter.
    pub fn backoff(&self, failures: u32) -> Duration {
        let doubled = self.first_backoff.saturating_mul(1u32 << failures.saturating_sub(1).min(30));
        doubled.min(self.max_backoff)
    }

    /// After failure number `failures` (1 for the first), `elapsed` since the first try:
    /// how long to wait before trying again, or `None` to give up. `retry_after` is the
    /// source's own answer to "when" (HTTP `Retry-After`); it is honoured when longer than
    /// the backoff, never to retry sooner.
    pub fn next_wait(&self, failures: u32, elapsed: Duration, retry_after: Option<Duration>) -> Option<Duration> {
        self.wait_with(failures, elapsed, retry_after, rand::random::<f64>())
    }

    /// [`RetryPolicy::next_wait`] with the random draw `unit` in [0, 1) given.
    fn wait_with(&self, failures: u32, elapsed: Duration, retry_after: Option<Duration>, unit: f64) -> Option<Duration> {
        if self.max_retries.is_some_and(|m| failures > m) {
            return None;
        }
        let base = self.backoff(failures);
        let wait = match retry_after {
            Some(r) => r.min(self.max_retry_after).max(base),
            None => base + base.mul_f64(self.jitter.clamp(0.0, 1.0) * unit.clamp(0.0, 1.0)),
        };
        if self.budget.is_some_and(|b| elapsed.saturating_add(wait) > b) {
            return None;
        }
        Some(wait)
    }

    /// A tracker of one operation's failures under this policy.
    pub fn start(&self) -> Retry {
        Retry { policy: *self, failures: 0, started: Instant::now() }
    }
}

impl Default for RetryPolicy {
    /// A registry request's: 5 retries.
    fn default() -> Self {
        RetryPolicy::attempts(5)
    }
}

/// One operation's failures so far, under a [`RetryPolicy`].
#[derive(Debug, Clone)]
pub struct Retry {
    policy: RetryPolicy,
    failures: u32,
    started: Instant,
}

impl Retry {
    /// Count a transient failure: `Some(wait)` to sleep before the next try, `None` to give
    /// up (see [`RetryPolicy::next_wait`]).
    pub fn failed(&mut self, retry_after: Option<Duration>) -> Option<Duration> {
        self.failures = self.failures.saturating_add(1);
        self.policy.next_wait(self.failures, self.started.elapsed(), retry_after)
    }

    /// Failures counted so far.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// Time since the operation started.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// Progress was made: the next failure is counted as a first one again (the budget, if
    /// any, still runs from the start).
    pub fn progressed(&mut self) {
        self.failures = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: fn(u64) -> Duration = Duration::from_millis;

    #[test]
    fn backoff_doubles_from_the_first_and_is_capped() {
        let p = RetryPolicy::attempts(100);
        let waits: Vec<_> = (1..=8).map(|n| p.wait_with(n, Duration::ZERO, None, 0.0).unwrap()).collect();
        assert_eq!(waits, [MS(200), MS(400), MS(800), MS(1600), MS(3200), MS(5000), MS(5000), MS(5000)]);
        // No overflow however many failures.
        assert_eq!(p.wait_with(99, Duration::ZERO, None, 0.0), Some(MS(5000)));
        assert_eq!(RetryPolicy::stall(Duration::from_secs(120)).backoff(1), MS(50));
    }

    #[test]
    fn attempts_cap_the_retries() {
        let p = RetryPolicy::attempts(4);
        assert!((1..=4).all(|n| p.next_wait(n, Duration::ZERO, None).is_some()));
        assert_eq!(p.next_wait(5, Duration::ZERO, None), None);
        assert_eq!(RetryPolicy::never().next_wait(1, Duration::ZERO, None), None);
        let mut r = RetryPolicy { first_backoff: MS(1), ..RetryPolicy::attempts(2) }.start();
        assert!(r.failed(None).is_some() && r.failed(None).is_some());
        r.progressed();
        assert!(r.failed(None).is_some() && r.failed(None).is_some(), "progress starts the count again");
        assert_eq!((r.failed(None), r.failures()), (None, 3));
    }

    #[test]
    fn a_budget_stops_retries_whose_wait_would_pass_it() {
        let p = RetryPolicy::stall(Duration::from_secs(120));
        // No cap on the number of retries.
        assert_eq!(p.wait_with(10_000, Duration::from_secs(100), None, 0.0), Some(MS(5000)));
        assert_eq!(p.wait_with(10_000, Duration::from_secs(115), None, 0.0), Some(MS(5000)));
        assert_eq!(p.wait_with(10_000, Duration::from_secs(116), None, 0.0), None);
        // Jitter counts: a wait that would end past the budget is not taken.
        assert_eq!(p.wait_with(10_000, Duration::from_secs(113), None, 0.99), None);
        // Both limits: whichever comes first.
        let both = RetryPolicy { budget: Some(Duration::from_secs(1)), ..RetryPolicy::attempts(3) };
        assert_eq!(both.wait_with(1, Duration::from_millis(900), None, 0.0), None);
        assert_eq!(both.wait_with(4, Duration::ZERO, None, 0.0), None);
    }

    #[test]
    fn retry_after_is_honoured_when_longer_and_capped() {
        let p = RetryPolicy::attempts(10);
        assert_eq!(p.wait_with(1, Duration::ZERO, Some(Duration::from_secs(3)), 0.7), Some(Duration::from_secs(3)));
        // Never sooner than the backoff.
        assert_eq!(p.wait_with(6, Duration::ZERO, Some(MS(1)), 0.7), Some(MS(5000)));
        // At most max_retry_after.
        assert_eq!(p.wait_with(1, Duration::ZERO, Some(Duration::from_secs(3600)), 0.0), Some(Duration::from_secs(60)));
        // And within the budget.
        let s = RetryPolicy::stall(Duration::from_secs(10));
        assert_eq!(s.wait_with(1, Duration::ZERO, Some(Duration::from_secs(30)), 0.0), None);
    }

    #[test]
    fn jitter_stays_within_its_fraction() {
        let p = RetryPolicy::attempts(10);
        for n in 1..10 {
            let base = p.backoff(n);
            assert_eq!(p.wait_with(n, Duration::ZERO, None, 0.0), Some(base));
            assert_eq!(p.wait_with(n, Duration::ZERO, None, 1.0), Some(base + base / 2));
            for _ in 0..200 {
                let w = p.next_wait(n, Duration::ZERO, None).unwrap();
                assert!(w >= base && w <= base + base / 2, "failure {n}: {w:?} outside {base:?}..+50%");
            }
        }
        let none = RetryPolicy { jitter: 0.0, ..RetryPolicy::attempts(10) };
        assert!((0..50).all(|_| none.next_wait(2, Duration::ZERO, None) == Some(MS(400))));
    }
}
