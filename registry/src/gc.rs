//! Garbage collection: retention decides which tags and manifests stay, then every blob a
//! kept manifest reaches is marked and the rest is swept.
//!
//! ```text
//! scan     list repositories/ (tags, manifest links, referrer entries, pull times) and
//!          read every manifest (and a snapshot's config, for its base)
//! plan     crate::retention: a verdict per tag and per manifest
//! apply    delete manifest links (their referrer entries and pull times), then tags,
//!          each under the protocol of crate::inuse; a manifest or tag a request relies
//!          on meanwhile is kept (rule in_use), and with it what it would have kept
//! mark     from kept manifests and kept tags' targets: config, layers, blobs, index
//!          children (walked). A referrer does not keep its subject (crate::retention)
//! sweep    unmarked blobs older than the grace period that no request relied on since
//!          the grace period before gc started; links to them; expired uploads; old marks
//! ```
//!
//! snapctl snapshot manifests list every blob they need (own and inherited packs, parent
//! configs, indexes and outboards), so marking through the kept manifests keeps whole
//! every image retention keeps, whatever it deletes of its chain's manifests.
//!
//! gc runs beside live servers. A push may rely on an unmarked blob, an untagged manifest
//! or a tag while gc runs (its HEAD found it, its manifest appears after gc's listing, it
//! re-tags): before deleting one gc marks it condemned (or retiring), then looks for such
//! uses; [`crate::inuse`] has the protocol and why at least one side always sees the
//! other. One gc at a time: `_gc/run` says one is running, and a second refuses to start
//! while the first keeps it fresh.
//!
//! A manifest that cannot be read or parsed aborts the run before anything is deleted:
//! sweeping without knowing its references could delete blobs it needs.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use imgfmt::OciDigest;

use crate::inuse::{self, GC_STALE, LEASE_STALE};
use crate::layout::{self, RepoKey};
use crate::name::{RepoName, Tag};
use crate::pulls::{self, PullLog};
use crate::refs::manifest_refs;
use crate::restore_lease;
use crate::retention::{self, Action, Inventory, ManifestFacts, Plan, RepoFacts, Retention, Rule, TagFacts};
use crate::store::{BlobStore, ObjectMeta, StoreError};

/// How often a running gc refreshes `_gc/run`.
const BEAT: Duration = Duration::from_secs(20);
/// Blobs (manifests, tags) condemned at a time: servers relying on one of them wait at
/// most for a batch.
const SWEEP_BATCH: usize = 64;
/// Largest snapshot config read for its `base` (the format's own limit).
const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// Options of a gc run.
#[derive(Debug, Clone)]
pub struct GcOptions {
    /// Unreferenced blobs younger than this, or used by a request less than this before
    /// gc started, are kept; so are manifests and tags a request relied on within it.
    /// Also the retention delay unless the configuration sets one.
    pub grace: Duration,
    /// Upload sessions idle for this long are removed.
    pub upload_ttl: Duration,
    /// Report only; delete nothing (and take no part in the protocol with servers).
    pub dry_run: bool,
    /// Which tags and manifests to keep (default: no policy, spec/registry.md §4).
    pub retention: Retention,
}

/// gc's grace period when nothing sets one.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(3600);
/// `serve`'s gc schedule when nothing sets one.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(24 * 3600);

impl Default for GcOptions {
    fn default() -> GcOptions {
        GcOptions { grace: DEFAULT_GRACE, upload_ttl: crate::upload::DEFAULT_UPLOAD_TTL, dry_run: false, retention: Retention::default() }
    }
}

impl GcOptions {
    /// How old an untagged manifest (or a referrer whose subject is missing) must be to go.
    pub fn delay(&self) -> Duration {
        self.retention.config.delay.unwrap_or(self.grace)
    }
}

/// Log a verdict: at `info` when it is acted on, at `debug` in a dry run, whose verdicts are
/// its output (`gc --dry-run` prints them; the web view's retention page shows them) and
/// not events in the server's log.
macro_rules! verdict {
    ($dry:expr, $($arg:tt)+) => {
        if $dry {
            tracing::debug!(dry_run = true, $($arg)+)
        } else {
            tracing::info!($($arg)+)
        }
    };
}

/// What a gc run found and did.
#[derive(Debug, Default, Clone, PartialEq, Eq, serde::Serialize)]
pub struct GcReport {
    /// Manifests read.
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
    /// Manifest links retention removed (or would).
    pub manifests_removed: usize,
    /// Tags retention removed (or would).
    pub tags_removed: usize,
    /// `_referrers` entries removed: of deleted referrers, or naming a manifest that is gone.
    pub referrers_removed: usize,
    /// Retention's verdicts: per tag and per manifest, keep or delete, the rule, the bytes.
    pub retention: Plan,
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
    /// stopped before it finished (a signal); its marks are removed, and the next run picks up from the start
    Stopped,
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
        store.delete_prefix(layout::GC_RETIRING).await?;
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
        abandon(store).await;
    }
}

/// Remove a run's marks and `_gc/run`: at the end of a run, or after a run was stopped
/// midway by its own process (a server shutting down), so servers need not wait for the
/// marks to go stale.
pub async fn abandon(store: &dyn BlobStore) {
    for prefix in [layout::GC_CONDEMNED, layout::GC_RETIRING] {
        if let Err(e) = store.delete_prefix(prefix).await {
            tracing::warn!(%e, prefix, "could not remove gc marks");
        }
    }
    if let Err(e) = store.delete(layout::GC_RUN).await {
        tracing::warn!(%e, "could not remove _gc/run");
    }
}

/// What marking found.
#[derive(Debug, Default)]
pub(crate) struct Marked {
    reachable: HashSet<OciDigest>,
    layer_links: Vec<(String, OciDigest)>,
    /// Retention's verdicts, as applied.
    plan: Plan,
    /// The blobs each manifest lists (itself included), for the bytes of each deletion.
    lists: HashMap<OciDigest, Vec<OciDigest>>,
}

/// Run gc over `store`.
pub async fn run(store: &dyn BlobStore, opts: &GcOptions) -> Result<GcReport, GcError> {
    run_until(store, opts, std::future::pending()).await
}

/// Run gc over `store` until done or until `stop` resolves (`snapctl gc` on SIGTERM or
/// SIGINT): then the run stops between two store operations, removes its marks and
/// `_gc/run` (servers need not wait for them to go stale, the next gc need not wait to
/// start), and answers [`GcError::Stopped`]. What it deleted before stays deleted; what
/// it had not decided stays.
pub async fn run_until(store: &dyn BlobStore, opts: &GcOptions, stop: impl std::future::Future<Output = ()>) -> Result<GcReport, GcError> {
    let mut run = GcRun::start(store, opts.dry_run).await?;
    let mut report = GcReport::default();
    let res = {
        let work = async {
            let marked = mark(store, &mut run, opts, &mut report).await?;
            sweep(store, &mut run, opts, marked, &mut report).await
        };
        tokio::select! {
            r = work => r,
            _ = stop => Err(GcError::Stopped),
        }
    };
    if matches!(res, Err(GcError::Stopped)) {
        tracing::warn!("gc stopped before it finished; removing its marks");
    }
    run.finish(store).await;
    res?;
    if !opts.dry_run {
        // When the last run finished: `serve`'s schedule counts from it.
        if let Err(e) = store.touch(layout::GC_LAST).await {
            tracing::warn!(%e, "could not record the end of the run");
        }
    }
    Ok(report)
}

/// The blobs that the manifests retention keeps reference, and the plan that keeps them,
/// without deleting anything or taking part in the protocol with servers.
///
/// The contract a writer that replaces blobs relies on (compaction writes live chunks
/// into fresh packs and pushes a manifest that no longer lists the old ones): a blob is
/// deleted only when it is not in this set, is older than `grace`, and no request relied
/// on it within `grace` before the run or during it (spec/registry.md §4).
pub async fn retained_blobs(store: &dyn BlobStore, opts: &GcOptions) -> Result<(HashSet<OciDigest>, Plan), GcError> {
    let dry = GcOptions { dry_run: true, ..opts.clone() };
    let mut run = GcRun::start(store, true).await?;
    let mut report = GcReport::default();
    let marked = mark(store, &mut run, &dry, &mut report).await?;
    Ok((marked.reachable, marked.plan))
}

/// What a scan of `repositories/` found besides the inventory.
#[derive(Debug, Default)]
struct Scan {
    inv: Inventory,
    layer_links: Vec<(String, OciDigest)>,
    /// `_referrers` keys: (repository, referrer) → keys naming it.
    referrer_keys: HashMap<(String, OciDigest), Vec<String>>,
    /// `_leases` keys: (key, when written, repository, manifest).
    lease_keys: Vec<(String, SystemTime, RepoName, OciDigest)>,
}

async fn scan(store: &dyn BlobStore, run: &mut GcRun, report: &mut GcReport) -> Result<Scan, GcError> {
    let mut out = Scan::default();
    for m in store.list(layout::REPOS).await? {
        let Some(k) = layout::parse_repo_key(&m.key) else { continue };
        match k {
            RepoKey::Layer(_, d) => out.layer_links.push((m.key.clone(), d)),
            RepoKey::Manifest(r, d) => {
                out.inv.repos.entry(r.to_string()).or_default().manifests.insert(d, m.modified);
            }
            RepoKey::Tag(r, t) => match store.get_bytes(&m.key).await {
                Ok(b) => match std::str::from_utf8(&b).ok().and_then(|s| s.trim().parse().ok()) {
                    Some(target) => {
                        out.inv.repos.entry(r.to_string()).or_default().tags.insert(t.to_string(), TagFacts { target, pushed: m.modified });
                    }
                    None => tracing::warn!(key = %m.key, "tag does not hold a digest; ignored"),
                },
                Err(e) if e.is_not_found() => {}
                Err(e) => return Err(e.into()),
            },
            RepoKey::Referrer(r, s, d) => {
                out.inv.repos.entry(r.to_string()).or_default().referrer_entries.push((s, d.clone()));
                out.referrer_keys.entry((r.to_string(), d)).or_default().push(m.key.clone());
            }
            RepoKey::Pulled(r) => {
                let p = pulls::read(store, &r).await?;
                out.inv.repos.entry(r.to_string()).or_default().pulled = p;
            }
            RepoKey::Lease(r, d) => {
                if let Some(end) = restore_lease::read(store, &m).await? {
                    out.inv.repos.entry(r.to_string()).or_default().leased.insert(d.clone(), end);
                }
                out.lease_keys.push((m.key.clone(), m.modified, r, d));
            }
        }
    }
    // Every manifest a repository links, a tag names, a referrer entry names, or an
    // index lists.
    let mut todo: Vec<OciDigest> = Vec::new();
    for repo in out.inv.repos.values() {
        todo.extend(repo.manifests.keys().cloned());
        todo.extend(repo.tags.values().map(|t| t.target.clone()));
        todo.extend(repo.referrer_entries.iter().map(|(_, r)| r.clone()));
    }
    let mut walked: HashSet<OciDigest> = HashSet::new();
    while let Some(d) = todo.pop() {
        if !walked.insert(d.clone()) {
            continue;
        }
        run.beat(store).await?;
        let bytes = match store.get_bytes(&layout::blob(&d)).await {
            Ok(b) => b,
            Err(e) if e.is_not_found() => {
                // A linked manifest without bytes has nothing left to protect.
                tracing::warn!(digest = %d, "manifest content missing");
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        report.manifests += 1;
        let json: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| GcError::BadManifest { digest: d.clone(), reason: e.to_string() })?;
        let refs = manifest_refs(&json).map_err(|e| GcError::BadManifest { digest: d.clone(), reason: e.message })?;
        let mut facts = ManifestFacts {
            size: bytes.len() as u64,
            artifact_type: json.get("artifactType").or_else(|| json.pointer("/config/mediaType")).and_then(|v| v.as_str()).map(str::to_owned),
            subject: refs.subject,
            ..ManifestFacts::default()
        };
        facts.layer_types =
            json.get("layers").and_then(|v| v.as_array()).into_iter().flatten().filter_map(|l| l.get("mediaType")?.as_str().map(str::to_owned)).collect();
        for (child, is_manifest) in refs.children {
            if is_manifest {
                todo.push(child.clone());
                facts.children.push(child);
            } else {
                facts.blobs.push(child);
            }
        }
        facts.base = snapshot_base(store, &json).await?;
        out.inv.manifests.insert(d, facts);
    }
    Ok(out)
}

/// A snapctl snapshot's `base.manifest` (spec/format.md §5), read from its config. An
/// unreadable config names no base: its blobs are kept by the manifest all the same.
async fn snapshot_base(store: &dyn BlobStore, manifest: &serde_json::Value) -> Result<Option<OciDigest>, GcError> {
    if manifest.pointer("/config/mediaType").and_then(|v| v.as_str()) != Some(imgfmt::media::CONFIG) {
        return Ok(None);
    }
    let Some(cd) = manifest.pointer("/config/digest").and_then(|v| v.as_str()).and_then(|s| s.parse::<OciDigest>().ok()) else { return Ok(None) };
    let key = layout::blob(&cd);
    match store.head(&key).await {
        Ok(m) if m.size <= MAX_CONFIG_BYTES => {}
        Ok(_) => return Ok(None),
        Err(e) if e.is_not_found() => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let raw = match store.get_bytes(&key).await {
        Ok(b) => b,
        Err(e) if e.is_not_found() => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let cfg: serde_json::Value = match serde_json::from_slice(&raw) {
        Ok(v) => v,
        Err(e) => {
            tracing::warn!(digest = %cd, %e, "snapshot config is not JSON; its base (if any) is not kept for it");
            return Ok(None);
        }
    };
    Ok(cfg.pointer("/base/manifest").and_then(|v| v.as_str()).and_then(|s| s.parse().ok()))
}

/// Scan, decide (retention), apply what retention decided, and mark every blob a kept
/// manifest reaches.
pub(crate) async fn mark(store: &dyn BlobStore, run: &mut GcRun, opts: &GcOptions, report: &mut GcReport) -> Result<Marked, GcError> {
    let scan = scan(store, run, report).await?;
    let mut plan = retention::plan(&opts.retention, &scan.inv, run.started, opts.delay());
    let retention_dry = plan.dry_run;
    plan.dry_run = plan.dry_run || opts.dry_run;
    if !retention_dry {
        apply(store, run, opts, &scan, &mut plan, report).await?;
        if !opts.dry_run {
            drop_spent_leases(store, &scan, &plan, run.started, opts.delay()).await?;
        }
    }
    // Roots: what the plan keeps; with retention in dry run, everything (nothing goes).
    let mut todo: Vec<OciDigest> = if retention_dry {
        let mut all: Vec<OciDigest> = scan.inv.repos.values().flat_map(|r| r.manifests.keys().cloned()).collect();
        all.extend(scan.inv.repos.values().flat_map(|r| r.tags.values().map(|t| t.target.clone())));
        all
    } else {
        retention::kept_roots(&plan).into_iter().collect()
    };
    let mut out = Marked { layer_links: scan.layer_links, ..Marked::default() };
    let mut walked: HashSet<OciDigest> = HashSet::new();
    while let Some(d) = todo.pop() {
        out.reachable.insert(d.clone());
        if !walked.insert(d.clone()) {
            continue;
        }
        if let Some(f) = scan.inv.manifests.get(&d) {
            out.reachable.extend(f.blobs.iter().cloned());
            todo.extend(f.children.iter().cloned());
        }
    }
    out.lists = scan.inv.manifests.into_iter().map(|(d, f)| (d.clone(), std::iter::once(d).chain(f.blobs).collect())).collect();
    report.marked = out.reachable.len();
    out.plan = plan;
    Ok(out)
}

/// Delete the restore lease objects that no longer count: unreadable ones, those of a
/// manifest that is gone (and whose lease ended), and those that ended more than `delay`
/// before the run started.
async fn drop_spent_leases(store: &dyn BlobStore, scan: &Scan, plan: &Plan, started: SystemTime, delay: Duration) -> Result<(), GcError> {
    let deleted = retention::deleted_by_repo(plan);
    for (key, written, r, d) in &scan.lease_keys {
        let repo = scan.inv.repos.get(r.as_str());
        let end = repo.and_then(|x| x.leased.get(d));
        let linked = repo.is_some_and(|x| x.manifests.contains_key(d)) && !deleted.get(r.as_str()).is_some_and(|g| g.contains(d));
        let spent = match end {
            None => true,
            Some(end) => (!linked && *end <= started) || end.checked_add(delay).is_some_and(|t| t <= started),
        };
        if !spent {
            continue;
        }
        // Renewed since the scan: a live restore's, not the one judged.
        match store.head(key).await {
            Ok(now) if now.modified == *written => {}
            Ok(_) => continue,
            Err(e) if e.is_not_found() => continue,
            Err(e) => return Err(e.into()),
        }
        tracing::debug!(repo = %r, digest = %d, "drop a spent restore lease");
        match store.delete(key).await {
            Err(e) if !e.is_not_found() => return Err(e.into()),
            _ => {}
        }
    }
    Ok(())
}

/// A planned deletion of manifest `d` from repository `repo`, with what keeps it should
/// one of those be kept after all (a request relied on it during the run).
#[derive(Debug)]
struct Doomed {
    repo: String,
    d: OciDigest,
    /// (manifest whose keeping keeps this one, the rule it keeps it by).
    keepers: Vec<(OciDigest, Rule)>,
}

/// Delete what the plan deletes, under the protocol of crate::inuse: manifests (keepers
/// before what they would keep), then tags. Verdicts of what a request turns out to rely
/// on become `in_use` (and what those keep, kept). In a dry run, only the checks.
async fn apply(store: &dyn BlobStore, run: &mut GcRun, opts: &GcOptions, scan: &Scan, plan: &mut Plan, report: &mut GcReport) -> Result<(), GcError> {
    let dry = opts.dry_run;
    let doomed = doomed_in_order(plan, scan);
    let keep_after = run.keep_after(opts.grace);
    let (mut kept, gone) = sweep_manifests(store, run, keep_after, dry, scan, &doomed, report).await?;
    for v in plan.manifests.iter_mut() {
        if let Some(rule) = kept.remove(&(v.repository.clone(), v.digest.clone())) {
            v.action = Action::Keep;
            v.rule = rule;
        }
    }
    sweep_tags(store, run, dry, scan, plan, report).await?;
    drop_orphan_referrers(store, dry, scan, report).await?;
    if !dry {
        for (repo, ds) in &gone {
            let r = RepoName::parse(repo).expect("scanned names are valid");
            pulls::forget(store, &r, &ds.iter().collect()).await?;
        }
    }
    Ok(())
}

/// The plan's manifest deletions, each with the planned deletions that would keep it if
/// kept (its subject, an index listing it, a snapshot naming it as base, by the keep
/// relations of crate::retention), ordered so that keepers come first.
fn doomed_in_order(plan: &Plan, scan: &Scan) -> Vec<Doomed> {
    let facts = &scan.inv.manifests;
    let mut doomed: Vec<Doomed> = plan.deleted_manifests().map(|v| Doomed { repo: v.repository.clone(), d: v.digest.clone(), keepers: Vec::new() }).collect();
    let planned: HashSet<(String, OciDigest)> = doomed.iter().map(|x| (x.repo.clone(), x.d.clone())).collect();
    let mut kept_by: HashMap<(String, OciDigest), Vec<(OciDigest, Rule)>> = HashMap::new();
    let no_repo = RepoFacts::default();
    for (repo, d) in &planned {
        let Some(f) = facts.get(d) else { continue };
        let linked = scan.inv.repos.get(repo).unwrap_or(&no_repo);
        for (target, rule) in retention::kept_by_manifest(d, f, linked) {
            if planned.contains(&(repo.clone(), target.clone())) {
                kept_by.entry((repo.clone(), target.clone())).or_default().push((d.clone(), rule));
            }
        }
        // The other way round: the subject keeps this one.
        if let Some((s, rule)) = retention::referrer_kept_by(f) {
            if planned.contains(&(repo.clone(), s.clone())) {
                kept_by.entry((repo.clone(), d.clone())).or_default().push((s.clone(), rule));
            }
        }
    }
    for x in &mut doomed {
        x.keepers = kept_by.remove(&(x.repo.clone(), x.d.clone())).unwrap_or_default();
    }
    keepers_first(doomed)
}

/// Manifests kept after all, by (repository, digest), with the rule that keeps them; and
/// the manifests deleted, by repository.
type ManifestSweep = (HashMap<(String, OciDigest), Rule>, BTreeMap<String, HashSet<OciDigest>>);

/// Delete the doomed manifests batch by batch, each batch condemned first; a manifest
/// stays when a kept keeper keeps it or a request relies on it (leased, or used since
/// `keep_after`).
async fn sweep_manifests(
    store: &dyn BlobStore,
    run: &mut GcRun,
    keep_after: Option<SystemTime>,
    dry: bool,
    scan: &Scan,
    doomed: &[Doomed],
    report: &mut GcReport,
) -> Result<ManifestSweep, GcError> {
    let mut kept: HashMap<(String, OciDigest), Rule> = HashMap::new();
    let mut gone: BTreeMap<String, HashSet<OciDigest>> = BTreeMap::new();
    for batch in doomed.chunks(SWEEP_BATCH) {
        if !dry {
            for x in batch {
                run.beat(store).await?;
                store.touch(&layout::gc_condemned(&x.d)).await?;
            }
        }
        let leased = inuse::leases(store, run.started.checked_sub(LEASE_STALE), dry).await?;
        for x in batch {
            run.beat(store).await?;
            let key = (x.repo.clone(), x.d.clone());
            let by_keeper = x.keepers.iter().find(|(k, _)| kept.contains_key(&(x.repo.clone(), k.clone()))).map(|(_, r)| r.clone());
            if let Some(rule) = by_keeper {
                kept.insert(key, rule);
            } else if used_since(store, &x.d, keep_after).await? || leased.digests.contains(&x.d) {
                verdict!(dry, repo = %x.repo, digest = %x.d, "keep manifest: a request relies on it");
                kept.insert(key, Rule::InUse);
            } else {
                verdict!(dry, repo = %x.repo, digest = %x.d, "delete manifest");
                report.manifests_removed += 1;
                if !dry {
                    run.check_alive()?;
                    let r = RepoName::parse(&x.repo).expect("scanned names are valid");
                    // Referrer entries first: a listed referrer must resolve.
                    for k in scan.referrer_keys.get(&key).into_iter().flatten() {
                        store.delete(k).await?;
                    }
                    store.delete(&layout::manifest_link(&r, &x.d)).await?;
                }
                report.referrers_removed += scan.referrer_keys.get(&key).map_or(0, Vec::len);
                gone.entry(x.repo.clone()).or_default().insert(x.d.clone());
            }
        }
        if !dry {
            for x in batch {
                store.delete(&layout::gc_condemned(&x.d)).await?;
            }
        }
    }
    Ok((kept, gone))
}

/// Whether a request marked manifest `d` used at or after `keep_after` (its `gc_used`
/// marker is that recent).
async fn used_since(store: &dyn BlobStore, d: &OciDigest, keep_after: Option<SystemTime>) -> Result<bool, GcError> {
    let used = match store.head(&layout::gc_used(d)).await {
        Ok(u) => Some(u.modified),
        Err(e) if e.is_not_found() => None,
        Err(e) => return Err(e.into()),
    };
    Ok(used.is_some_and(|t| keep_after.is_none_or(|k| t >= k)))
}

/// Delete the plan's doomed tags batch by batch, each batch marked retiring first. A tag
/// stays (its verdict becomes `in_use`) when its target or subject was kept after all,
/// when a push holds a lease on it, or when it was written again since the scan.
async fn sweep_tags(store: &dyn BlobStore, run: &mut GcRun, dry: bool, scan: &Scan, plan: &mut Plan, report: &mut GcReport) -> Result<(), GcError> {
    let still_kept = |repo: &str, d: &OciDigest| plan.manifests.iter().any(|v| v.repository == repo && &v.digest == d && v.action == Action::Keep);
    let mut tag_flips: Vec<usize> = Vec::new();
    let doomed_tags: Vec<usize> = plan.tags.iter().enumerate().filter(|(_, t)| t.action == Action::Delete).map(|(i, _)| i).collect();
    let mut to_delete: Vec<usize> = Vec::new();
    for i in doomed_tags {
        let t = &plan.tags[i];
        if still_kept(&t.repository, &t.target) || t.rule.gone_subject().is_some_and(|s| still_kept(&t.repository, s)) {
            tag_flips.push(i);
        } else {
            to_delete.push(i);
        }
    }
    for batch in to_delete.chunks(SWEEP_BATCH) {
        let names: Vec<(RepoName, Tag)> = batch
            .iter()
            .map(|&i| {
                (RepoName::parse(&plan.tags[i].repository).expect("scanned names are valid"), Tag::parse(&plan.tags[i].tag).expect("scanned tags are valid"))
            })
            .collect();
        if !dry {
            for (r, t) in &names {
                run.beat(store).await?;
                store.touch(&layout::gc_retiring_tag(r, t)).await?;
            }
        }
        let leased = inuse::leases(store, run.started.checked_sub(LEASE_STALE), dry).await?;
        for (&i, (r, t)) in batch.iter().zip(&names) {
            run.beat(store).await?;
            let planned = &plan.tags[i];
            // The tag as it is now: re-pushed since the scan (another target, or written
            // again), it is a new push's, not the one retention judged.
            let now = match store.head(&layout::tag(r, t)).await {
                Ok(m) => Some(m.modified),
                Err(e) if e.is_not_found() => None,
                Err(e) => return Err(e.into()),
            };
            let scanned = scan.inv.repos.get(&planned.repository).and_then(|x| x.tags.get(&planned.tag)).map(|f| f.pushed);
            let rewritten = now.is_some() && now != scanned;
            if leased.tags.contains(&inuse::lease_tag_name(r, t)) || rewritten {
                tracing::info!(repo = %r, tag = %t, "keep tag: a push is writing it");
                tag_flips.push(i);
                continue;
            }
            verdict!(dry, repo = %r, tag = %t, "delete tag");
            report.tags_removed += 1;
            if !dry && now.is_some() {
                run.check_alive()?;
                store.delete(&layout::tag(r, t)).await?;
            }
        }
        if !dry {
            for (r, t) in &names {
                store.delete(&layout::gc_retiring_tag(r, t)).await?;
            }
        }
    }
    for i in tag_flips {
        plan.tags[i].action = Action::Keep;
        plan.tags[i].rule = Rule::InUse;
    }
    Ok(())
}

/// Delete referrer entries naming a manifest that is not linked (a client deleted it).
async fn drop_orphan_referrers(store: &dyn BlobStore, dry: bool, scan: &Scan, report: &mut GcReport) -> Result<(), GcError> {
    for ((repo, d), keys) in &scan.referrer_keys {
        let linked = scan.inv.repos.get(repo).is_some_and(|r| r.manifests.contains_key(d));
        if !linked {
            report.referrers_removed += keys.len();
            if !dry {
                for k in keys {
                    store.delete(k).await?;
                }
            }
        }
    }
    Ok(())
}

/// `doomed` in an order where every entry comes after the entries that keep it.
fn keepers_first(doomed: Vec<Doomed>) -> Vec<Doomed> {
    let index: HashMap<(String, OciDigest), usize> = doomed.iter().enumerate().map(|(i, x)| ((x.repo.clone(), x.d.clone()), i)).collect();
    let mut state = vec![0u8; doomed.len()]; // 0 new, 1 visiting, 2 done
    let mut order = Vec::with_capacity(doomed.len());
    for start in 0..doomed.len() {
        // Iterative depth-first: keepers are emitted before what they keep.
        let mut stack = vec![(start, false)];
        while let Some((i, expanded)) = stack.pop() {
            if expanded {
                state[i] = 2;
                order.push(i);
                continue;
            }
            if state[i] != 0 {
                continue;
            }
            state[i] = 1;
            stack.push((i, true));
            for (k, _) in &doomed[i].keepers {
                if let Some(&j) = index.get(&(doomed[i].repo.clone(), k.clone())) {
                    if state[j] == 0 {
                        stack.push((j, false));
                    }
                }
            }
        }
    }
    let mut slots: Vec<Option<Doomed>> = doomed.into_iter().map(Some).collect();
    order.into_iter().map(|i| slots[i].take().expect("each once")).collect()
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
    let mut plan = marked.plan;
    bytes_per_deletion(&mut plan, &marked.lists, &candidates);
    report.retention = plan;
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
                verdict!(dry, digest = %d, "keep blob: a request relies on it");
            } else {
                report.swept += 1;
                report.swept_bytes += m.size;
                verdict!(dry, digest = %d, size = m.size, "sweep blob");
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
        verdict!(dry, %id, "remove expired upload");
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

/// Fill each deleted manifest's `bytes` (blobs about to go that only it lists, itself
/// included) and `shared_bytes` (blobs about to go that other deleted manifests list too,
/// at the first of them in the plan's order).
fn bytes_per_deletion(plan: &mut Plan, lists: &HashMap<OciDigest, Vec<OciDigest>>, going: &[(ObjectMeta, OciDigest)]) {
    let size: HashMap<&OciDigest, u64> = going.iter().map(|(m, d)| (d, m.size)).collect();
    let mut listers: HashMap<&OciDigest, usize> = HashMap::new();
    let deleted: Vec<usize> = plan.manifests.iter().enumerate().filter(|(_, v)| v.action == Action::Delete).map(|(i, _)| i).collect();
    // A digest deleted from two repositories is one deletion of its bytes.
    let mut distinct: HashSet<&OciDigest> = HashSet::new();
    for &i in &deleted {
        let d = &plan.manifests[i].digest;
        if distinct.insert(d) {
            for b in lists.get(d).into_iter().flatten().collect::<HashSet<_>>() {
                if size.contains_key(b) {
                    *listers.entry(b).or_default() += 1;
                }
            }
        }
    }
    // Each blob is counted once, at the first deletion (in the plan's order) listing it,
    // so that the verdicts' bytes sum to what goes.
    let mut counted: HashSet<&OciDigest> = HashSet::new();
    let mut per: Vec<(usize, u64, u64)> = Vec::new();
    for &i in &deleted {
        let (mut own, mut shared) = (0, 0);
        for b in lists.get(&plan.manifests[i].digest).into_iter().flatten() {
            if let Some(&n) = size.get(b) {
                if !counted.insert(b) {
                    continue;
                }
                if listers.get(b).copied().unwrap_or(0) <= 1 {
                    own += n;
                } else {
                    shared += n;
                }
            }
        }
        per.push((i, own, shared));
    }
    for (i, own, shared) in per {
        plan.manifests[i].bytes = own;
        plan.manifests[i].shared_bytes = shared;
    }
}

/// gc on a schedule inside `serve`.
#[derive(Debug, Clone)]
pub struct Schedule {
    /// Time between the end of one run (any replica's, or `snapctl gc`'s: `_gc/last`) and
    /// the next. A store never collected waits one interval from the server's start.
    pub interval: Duration,
    /// What each run does.
    pub options: GcOptions,
}

/// A running [`Schedule`].
#[derive(Debug)]
pub struct Scheduled {
    task: tokio::task::JoinHandle<()>,
    stop: tokio::sync::watch::Sender<bool>,
    running: Arc<AtomicBool>,
}

/// How long a server shutting down waits for a scheduled run to finish before it stops it.
pub const STOP_WAIT: Duration = Duration::from_secs(30);

impl Schedule {
    /// Start running gc every `interval`; pulls recorded in `pulls` are written before
    /// each run, so `pulled_within` sees them; `changed` is notified after each run (the
    /// server's store totals are taken again).
    pub fn spawn(self, store: Arc<dyn BlobStore>, pulls: Arc<PullLog>, changed: Arc<tokio::sync::Notify>) -> Scheduled {
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        let running = Arc::new(AtomicBool::new(false));
        let r = running.clone();
        let task = tokio::spawn(async move {
            let started = SystemTime::now();
            let check = (self.interval / 4).clamp(Duration::from_secs(1), Duration::from_secs(600));
            loop {
                let last = match store.head(layout::GC_LAST).await {
                    Ok(m) => Some(m.modified),
                    Err(e) if e.is_not_found() => None,
                    Err(e) => {
                        tracing::warn!(%e, "reading _gc/last");
                        None
                    }
                };
                // A due time past the clock's range is never.
                let due = last.unwrap_or(started).checked_add(self.interval);
                let now = SystemTime::now();
                let mut wait = check;
                if due.is_some_and(|due| now >= due) {
                    r.store(true, Relaxed);
                    if let Err(e) = pulls.flush(store.as_ref()).await {
                        tracing::warn!(%e, "writing pull times before gc");
                    }
                    match run(store.as_ref(), &self.options).await {
                        Ok(rep) => {
                            let gone = rep.retention.manifests.iter().filter(|v| v.action == crate::retention::Action::Delete);
                            pulls.forget_pending(gone.map(|v| (v.repository.as_str(), &v.digest)));
                            tracing::info!(
                                manifests_removed = rep.manifests_removed,
                                tags_removed = rep.tags_removed,
                                swept = rep.swept,
                                swept_bytes = rep.swept_bytes,
                                "scheduled gc done"
                            )
                        }
                        Err(GcError::Running { .. }) => tracing::info!("scheduled gc: another gc is running"),
                        Err(e) => tracing::warn!(%e, "scheduled gc failed"),
                    }
                    changed.notify_one();
                    r.store(false, Relaxed);
                } else if let Some(due) = due {
                    wait = wait.min(due.duration_since(now).unwrap_or_default());
                }
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = stopped.changed() => return,
                }
            }
        });
        Scheduled { task, stop, running }
    }
}

impl Scheduled {
    /// Stop the schedule: a run under way gets [`STOP_WAIT`] to finish; after that it is
    /// stopped and its marks removed, so servers do not wait for them to go stale.
    pub async fn stop(mut self, store: &dyn BlobStore) {
        let _ = self.stop.send(true);
        match tokio::time::timeout(STOP_WAIT, &mut self.task).await {
            Ok(_) => {}
            Err(_) => {
                self.task.abort();
                let _ = (&mut self.task).await;
                if self.running.load(Relaxed) {
                    tracing::warn!("stopped a scheduled gc midway; it resumes at the next run");
                    abandon(store).await;
                }
            }
        }
    }
}
