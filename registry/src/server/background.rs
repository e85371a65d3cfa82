//! What a serving server does beside requests: idle upload sessions swept, the htpasswd
//! file watched (and reloaded on demand), the store's totals scanned, recorded pulls
//! written, gc run on its schedule, and a store from before the catalog indexed once at
//! start. Each task ends when its handle is dropped with the listener.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use super::Server;

/// Aborts a background task when dropped (the server's sweeper ends with its listener).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// What [`Server::spawn_background`] started.
pub(super) struct Background {
    _sweeper: AbortOnDrop,
    _watcher: Option<AbortOnDrop>,
    _scanner: Option<AbortOnDrop>,
    _pulls: AbortOnDrop,
    gc: Option<crate::gc::Scheduled>,
}

impl Server {
    /// The tasks a serving server runs beside requests: the upload sweeper, the htpasswd
    /// watcher, the store-totals scanner, the pull-time writer and the gc schedule.
    pub(super) fn spawn_background(self: &Arc<Self>) -> Background {
        Background {
            _sweeper: self.spawn_upload_sweeper(),
            _watcher: self.spawn_htpasswd_watcher(),
            _scanner: self.spawn_stats_scanner(),
            _pulls: self.spawn_pull_writer(),
            gc: self.cfg.gc.clone().map(|g| g.spawn(self.store.clone(), self.pulls.clone(), self.stats.rescan_signal())),
        }
    }

    /// After the listener stopped: let a gc run finish (or abandon it cleanly), and write
    /// the pulls recorded since the last flush.
    pub(super) async fn stop_background(&self, b: Background) {
        if let Some(g) = b.gc {
            g.stop(self.store.as_ref()).await;
        }
        if let Err(e) = self.pulls.flush(self.store.as_ref()).await {
            tracing::warn!(%e, "writing pull times at shutdown");
        }
    }

    /// Index a store laid out before the catalog existed (once per store; see
    /// [`crate::catalog`]). A failure is logged and retried at the next start: the catalog
    /// then misses the old repositories, nothing else does.
    pub(super) async fn index_catalog(&self) {
        match self.catalog.build_if_missing().await {
            // A new store has nothing to index: only a store with repositories is news.
            Ok(Some(n)) if n > 0 => tracing::info!(repositories = n, "catalog: indexed a store written before the catalog existed"),
            Ok(_) => {}
            Err(e) => tracing::error!(%e, "catalog: could not index the store's repositories; /v2/_catalog lists only those pushed from now on"),
        }
    }

    /// Write recorded pulls every `pull_flush`, or sooner when many wait, until dropped.
    fn spawn_pull_writer(self: &Arc<Self>) -> AbortOnDrop {
        let s = self.clone();
        AbortOnDrop(tokio::spawn(async move {
            let every = s.cfg.pull_flush.max(Duration::from_secs(1));
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(every) => {}
                    _ = s.pulls.full.notified() => {}
                }
                if let Err(e) = s.pulls.flush(s.store.as_ref()).await {
                    tracing::warn!(%e, "writing pull times");
                }
            }
        }))
    }

    /// Remove idle upload sessions every quarter of the TTL (1 s to 10 min), until dropped.
    fn spawn_upload_sweeper(self: &Arc<Self>) -> AbortOnDrop {
        let s = self.clone();
        AbortOnDrop(tokio::spawn(async move {
            let ttl = s.cfg.upload_ttl;
            let every = (ttl / 4).clamp(Duration::from_secs(1), Duration::from_secs(600));
            loop {
                tokio::time::sleep(every).await;
                match s.uploads.expire(ttl).await {
                    Ok(n) => {
                        s.metrics.uploads_expired.fetch_add(n as u64, Relaxed);
                    }
                    Err(e) => tracing::warn!(%e, "sweeping idle upload sessions"),
                }
            }
        }))
    }

    /// Take the store's totals now, then every `stats_interval`, until dropped.
    fn spawn_stats_scanner(self: &Arc<Self>) -> Option<AbortOnDrop> {
        let every = self.cfg.stats_interval;
        if every.is_zero() {
            return None;
        }
        let s = self.clone();
        let wanted = s.stats.rescan_signal();
        Some(AbortOnDrop(tokio::spawn(async move {
            loop {
                match s.stats.scan().await {
                    Ok(t) => tracing::debug!(blobs = t.blobs, bytes = t.stored_bytes, ms = t.scan_ms, "store totals taken"),
                    Err(e) => tracing::warn!(%e, "taking the store's totals"),
                }
                // Every interval, and when a gc run of this server changed the store.
                tokio::select! {
                    _ = tokio::time::sleep(every) => {}
                    _ = wanted.notified() => {}
                }
            }
        })))
    }

    /// Check the htpasswd file for changes every `htpasswd_poll`, until dropped.
    fn spawn_htpasswd_watcher(self: &Arc<Self>) -> Option<AbortOnDrop> {
        let every = self.cfg.htpasswd_poll;
        if self.htpasswd.is_none() || every.is_zero() {
            return None;
        }
        let s = self.clone();
        Some(AbortOnDrop(tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                s.check_htpasswd(false).await;
            }
        })))
    }

    /// Reload the htpasswd file now, changed or not (`serve` calls this on SIGHUP).
    /// Returns whether the users were replaced; failures are logged.
    pub async fn reload_htpasswd(self: &Arc<Self>) -> bool {
        self.check_htpasswd(true).await
    }

    async fn check_htpasswd(self: &Arc<Self>, force: bool) -> bool {
        let s = self.clone();
        tokio::task::spawn_blocking(move || match (&s.htpasswd, &s.cfg.auth) {
            (Some(f), Some(a)) => f.check(a, force),
            _ => false,
        })
        .await
        .unwrap_or(false)
    }
}
