//! Garbage collection: mark every blob some manifest reaches, sweep the rest.
//!
//! Mark roots are all manifests linked in any repository (tagged or not) plus tag
//! targets. From each manifest, config, layers (and `blobs` of artifact manifests),
//! index children and `subject` are marked; child manifests are walked too. snapctl
//! snapshot manifests list every blob they need (own and inherited packs, parent
//! indexes) as layers, so this reaches everything a snapshot needs.
//!
//! Sweep deletes unmarked blobs that are older than the grace period and that no
//! request relied on since the grace period before gc started, then repository blob
//! links to deleted blobs, expired upload sessions, and use marks too old to matter.
//!
//! gc runs beside live servers. A push may rely on an unmarked blob while gc runs (its
//! HEAD found it, its manifest appears after gc's listing): before deleting a blob gc
//! marks it condemned, then looks for such uses; [`crate::inuse`] has the protocol and
//! why at least one side always sees the other. One gc at a time: `_gc/run` says one is
//! running, and a second refuses to start while the first keeps it fresh.
//!
//! A manifest that cannot be read or parsed aborts the run before anything is deleted:
//! sweeping without knowing its references could delete blobs it needs.

use std::collections::HashSet;
use std::time::{Duration, Instant, SystemTime};

use imgfmt::OciDigest;

use crate::inuse::{self, GC_STALE, LEASE_STALE};
use crate::layout::{self, RepoKey};
use crate::server::manifest_refs;
use crate::store::{BlobStore, ObjectMeta, StoreError};

/// How often a running gc refreshes `_gc/run`.
const BEAT: Duration = Duration::from_secs(20);
/// Blobs condemned at a time: servers relying on one of them wait at most for a batch.
const SWEEP_BATCH: usize = 64;

/// Options of a gc run.
#[derive(Debug, Clone)]
pub struct GcOptions {
    /// Unreferenced blobs younger than this, or used by a request less than this before
    /// gc started, are kept.
    pub grace: Duration,
    /// Upload sessions idle for this long are removed.
    pub upload_ttl: Duration,
    /// Report only; delete nothing (and take no part in the protocol with servers).
    pub dry_run: bool,
}

impl Default for GcOptions {
    fn default() -> GcOptions {
        GcOptions { grace: Duration::from_secs(3600), upload_ttl: crate::server::DEFAULT_UPLOAD_TTL, dry_run: false }
    }
}

/// What a gc run found and did.
#[derive(Debug, Default, Clone, PartialEq, Eq, serde::Serialize)]
pub struct GcReport {
    /// Manifests walked.
    pub manifests: usize,
    /// Distinct blobs marked reachable.
    pub marked: usize,
    /// Blobs in storage.
    pub blobs: usize,
    /// Unreferenced blobs deleted (or that would be, with `dry_run`).
    pub swept: usize,
    /// Bytes of those blobs.
    pub swept_bytes: u64,
    /// Unreferenced blobs kept because they are younger than the grace period.
    pub kept_young: usize,
    /// Unreferenced blobs kept because a request relied on them (within the grace
    /// period before gc started, or while it ran).
    pub kept_in_use: usize,
    /// Repository blob links removed because their blob was swept or is missing.
    pub links_removed: usize,
    /// Expired upload sessions removed.
    pub uploads_removed: usize,
}

/// Why gc stopped.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
#[non_exhaustive]
pub enum GcError {
    /// storage: {0}
    Store(#[from] StoreError),
    /// manifest {digest} is not a valid manifest ({reason}); refusing to sweep
    BadManifest {
        /// The manifest.
        digest: OciDigest,
        /// What is wrong.
        reason: String,
    },
    /// another gc is running (it refreshed _gc/run {age:?} ago); wait for it to finish, or remove _gc/run from the storage if that gc was killed
    Running {
        /// Since the other run last refreshed its mark.
        age: Duration,
    },
    /// could not refresh _gc/run for {0:?}; stopped before deleting more (servers may already treat this run as dead)
    Stalled(Duration),
}

/// One gc run's hold on the store: `_gc/run`, refreshed as the run goes.
#[derive(Debug)]
pub(crate) struct GcRun {
    /// When the run started, on the store's clock (the mtime of `_gc/run`).
    started: SystemTime,
    /// Last successful refresh of `_gc/run`.
    beat: Instant,
    dry_run: bool,
}

impl GcRun {
    /// Take `_gc/run` (refusing while another gc keeps it fresh) and clear condemned
    /// marks a stopped gc left. A dry run takes nothing.
    pub(crate) async fn start(store: &dyn BlobStore, dry_run: bool) -> Result<GcRun, GcError> {
        if dry_run {
            return Ok(GcRun { started: SystemTime::now(), beat: Instant::now(), dry_run });
        }
        match store.head(layout::GC_RUN).await {
            Ok(m) => {
                let age = SystemTime::now().duration_since(m.modified).unwrap_or_default();
                if age < GC_STALE {
                    return Err(GcError::Running { age });
                }
                tracing::warn!(?age, "taking over from a gc that stopped");
            }
            Err(e) if e.is_not_found() => {}
            Err(e) => return Err(e.into()),
        }
        let who = serde_json::json!({ "pid": std::process::id() });
        store.put(layout::GC_RUN, serde_json::to_vec(&who).expect("json").into()).await?;
        let beat = Instant::now();
        let started = store.head(layout::GC_RUN).await?.modified;
        // No other gc is alive, so every condemned mark is a stopped run's, and void.
        store.delete_prefix(layout::GC_CONDEMNED).await?;
        Ok(GcRun { started, beat, dry_run })
    }

    /// Refresh `_gc/run` if it is due.
    async fn beat(&mut self, store: &dyn BlobStore) -> Result<(), GcError> {
        if !self.dry_run && self.beat.elapsed() >= BEAT {
            store.touch(layout::GC_RUN).await?;
            self.beat = Instant::now();
        }
        Ok(())
    }

    /// Before a delete: servers treat a run whose `_gc/run` is [`GC_STALE`] old as dead
    /// and ignore its condemned marks, so stop well before that.
    fn check_alive(&self) -> Result<(), GcError> {
        let since = self.beat.elapsed();
        if !self.dry_run && since > GC_STALE / 2 {
            return Err(GcError::Stalled(since));
        }
        Ok(())
    }

    /// Uses at or after this keep an unmarked blob (`None`: every use does).
    fn keep_after(&self, grace: Duration) -> Option<SystemTime> {
        self.started.checked_sub(grace)
    }

    /// Drop the condemned marks and `_gc/run` (best effort: a leftover is void once stale).
    pub(crate) async fn finish(self, store: &dyn BlobStore) {
        if self.dry_run {
            return;
        }
        if let Err(e) = store.delete_prefix(layout::GC_CONDEMNED).await {
            tracing::warn!(%e, "could not remove condemned marks");
        }
        if let Err(e) = store.delete(layout::GC_RUN).await {
            tracing::warn!(%e, "could not remove _gc/run");
        }
    }
}

/// What marking found.
#[derive(Debug, Default)]
pub(crate) struct Marked {
    reachable: HashSet<OciDigest>,
    layer_links: Vec<(String, OciDigest)>,
}

/// Run gc over `store`.
pub async fn run(store: &dyn BlobStore, opts: &GcOptions) -> Result<GcReport, GcError> {
    let mut run = GcRun::start(store, opts.dry_run).await?;
    let mut report = GcReport::default();
    let res = async {
        let marked = mark(store, &mut run, &mut report).await?;
        sweep(store, &mut run, opts, marked, &mut report).await
    }
    .await;
    run.finish(store).await;
    res.map(|()| report)
}

/// Mark every blob a manifest reaches.
pub(crate) async fn mark(store: &dyn BlobStore, run: &mut GcRun, report: &mut GcReport) -> Result<Marked, GcError> {
    let repo_keys = store.list(layout::REPOS).await?;
    let mut todo: Vec<OciDigest> = Vec::new();
    let mut out = Marked::default();
    for m in &repo_keys {
        match layout::parse_repo_key(&m.key) {
            Some(RepoKey::Manifest(_, d)) | Some(RepoKey::Referrer(_, _, d)) => todo.push(d),
            Some(RepoKey::Tag(..)) => match store.get_bytes(&m.key).await {
                Ok(b) => {
                    if let Some(d) = std::str::from_utf8(&b).ok().and_then(|s| s.trim().parse().ok()) {
                        todo.push(d);
                    }
                }
                Err(e) if e.is_not_found() => {}
                Err(e) => return Err(e.into()),
            },
            Some(RepoKey::Layer(_, d)) => out.layer_links.push((m.key.clone(), d)),
            None => {}
        }
    }
    let mut walked: HashSet<OciDigest> = HashSet::new();
    while let Some(d) = todo.pop() {
        out.reachable.insert(d.clone());
        if !walked.insert(d.clone()) {
            continue;
        }
        run.beat(store).await?;
        let bytes = match store.get_bytes(&layout::blob(&d)).await {
            Ok(b) => b,
            Err(e) if e.is_not_found() => {
                // A subject may legitimately be absent; a linked manifest without bytes
                // has nothing left to protect.
                tracing::warn!(%d, "manifest content missing");
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        report.manifests += 1;
        let json: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| GcError::BadManifest { digest: d.clone(), reason: e.to_string() })?;
        let refs = manifest_refs(&json).map_err(|e| GcError::BadManifest { digest: d.clone(), reason: e.message })?;
        for (child, is_manifest) in refs.children {
            if is_manifest {
                todo.push(child);
            } else {
                out.reachable.insert(child);
            }
        }
        if let Some(s) = refs.subject {
            todo.push(s);
        }
    }
    report.marked = out.reachable.len();
    Ok(out)
}

/// Delete what marking did not reach and nothing relies on; then links to deleted
/// blobs, expired upload sessions and stale use marks.
pub(crate) async fn sweep(store: &dyn BlobStore, run: &mut GcRun, opts: &GcOptions, marked: Marked, report: &mut GcReport) -> Result<(), GcError> {
    let keep_after = run.keep_after(opts.grace);
    let old = |t: SystemTime| keep_after.is_some_and(|k| t < k);
    let mut candidates: Vec<(ObjectMeta, OciDigest)> = Vec::new();
    for m in store.list(layout::BLOBS).await? {
        let Some(d) = layout::parse_blob_key(&m.key) else { continue };
        report.blobs += 1;
        if marked.reachable.contains(&d) {
            continue;
        }
        if !old(m.modified) {
            report.kept_young += 1;
            continue;
        }
        candidates.push((m, d));
    }
    let dry = opts.dry_run;
    let mut gone: HashSet<OciDigest> = HashSet::new();
    for batch in candidates.chunks(SWEEP_BATCH) {
        // Condemn first, then look for uses: a request that missed the mark has touched
        // its use mark already (crate::inuse).
        if !dry {
            for (_, d) in batch {
                run.beat(store).await?;
                store.touch(&layout::gc_condemned(d)).await?;
            }
        }
        let leased = inuse::leased(store, run.started.checked_sub(LEASE_STALE), dry).await?;
        for (m, d) in batch {
            run.beat(store).await?;
            let used = match store.head(&layout::gc_used(d)).await {
                Ok(u) => Some(u.modified),
                Err(e) if e.is_not_found() => None,
                Err(e) => return Err(e.into()),
            };
            if leased.contains(d) || used.is_some_and(|t| !old(t)) {
                report.kept_in_use += 1;
                tracing::info!(%d, "keep blob: a request relies on it");
            } else {
                report.swept += 1;
                report.swept_bytes += m.size;
                tracing::info!(%d, size = m.size, dry_run = dry, "sweep blob");
                if !dry {
                    run.check_alive()?;
                    store.delete(&m.key).await?;
                }
                gone.insert(d.clone());
            }
            if !dry {
                store.delete(&layout::gc_condemned(d)).await?;
            }
        }
    }
    // Links to swept blobs: without them a HEAD would promise a blob that is gone.
    for (key, d) in marked.layer_links {
        if gone.contains(&d) {
            report.links_removed += 1;
            if !dry {
                store.delete(&key).await?;
            }
        }
    }
    let idle = crate::upload::idle_sessions(store, opts.upload_ttl).await?;
    report.uploads_removed = idle.len();
    for id in &idle {
        tracing::info!(%id, dry_run = dry, "remove expired upload");
        if !dry {
            crate::upload::remove_session(store, id).await?;
        }
    }
    if !dry {
        // Use marks older than any future run could count; re-read just before deleting,
        // so a use made since the listing keeps its mark.
        for m in store.list(layout::GC_USED).await? {
            if !old(m.modified) {
                continue;
            }
            match store.head(&m.key).await {
                Ok(now) if old(now.modified) => store.delete(&m.key).await?,
                _ => {}
            }
        }
    }
    Ok(())
}
