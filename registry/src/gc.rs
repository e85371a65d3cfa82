//! Garbage collection: mark every blob some manifest reaches, sweep the rest.
//!
//! Mark roots are all manifests linked in any repository (tagged or not) plus tag
//! targets. From each manifest, config, layers (and `blobs` of artifact manifests),
//! index children and `subject` are marked; child manifests are walked too. snapctl
//! snapshot manifests list every blob they need (own and inherited packs, parent
//! indexes) as layers, so this reaches everything a snapshot needs.
//!
//! Sweep deletes unmarked blobs whose mtime is older than the grace period (so blobs a
//! concurrent push uploaded but has not referenced yet survive), then repository blob
//! links to deleted blobs, then upload sessions older than the upload TTL.
//!
//! A manifest that cannot be read or parsed aborts the run before anything is deleted:
//! sweeping without knowing its references could delete blobs it needs.

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, SystemTime};

use crate::digest::Digest;
use crate::layout::{self, RepoKey};
use crate::server::manifest_refs;
use crate::store::{BlobStore, StoreError};

/// Options of a gc run.
#[derive(Debug, Clone)]
pub struct GcOptions {
    /// Unreferenced blobs younger than this are kept.
    pub grace: Duration,
    /// Upload sessions older than this are removed.
    pub upload_ttl: Duration,
    /// Report only; delete nothing.
    pub dry_run: bool,
}

impl Default for GcOptions {
    fn default() -> GcOptions {
        GcOptions { grace: Duration::from_secs(3600), upload_ttl: Duration::from_secs(24 * 3600), dry_run: false }
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
        digest: Digest,
        /// What is wrong.
        reason: String,
    },
}

/// Run gc over `store`.
pub async fn run(store: &dyn BlobStore, opts: &GcOptions) -> Result<GcReport, GcError> {
    let now = SystemTime::now();
    let mut report = GcReport::default();

    // Mark.
    let repo_keys = store.list(layout::REPOS).await?;
    let mut todo: Vec<Digest> = Vec::new();
    let mut layer_links: Vec<(String, Digest)> = Vec::new();
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
            Some(RepoKey::Layer(_, d)) => layer_links.push((m.key.clone(), d)),
            None => {}
        }
    }
    let mut marked: HashSet<Digest> = HashSet::new();
    let mut walked: HashSet<Digest> = HashSet::new();
    while let Some(d) = todo.pop() {
        marked.insert(d.clone());
        if !walked.insert(d.clone()) {
            continue;
        }
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
                marked.insert(child);
            }
        }
        if let Some(s) = refs.subject {
            todo.push(s);
        }
    }
    report.marked = marked.len();

    // Sweep blobs.
    let mut gone: HashSet<Digest> = HashSet::new();
    for m in store.list(layout::BLOBS).await? {
        let Some(d) = layout::parse_blob_key(&m.key) else { continue };
        report.blobs += 1;
        if marked.contains(&d) {
            continue;
        }
        let age = now.duration_since(m.modified).unwrap_or_default();
        if age < opts.grace {
            report.kept_young += 1;
            continue;
        }
        report.swept += 1;
        report.swept_bytes += m.size;
        tracing::info!(%d, size = m.size, dry_run = opts.dry_run, "sweep blob");
        if !opts.dry_run {
            store.delete(&m.key).await?;
        }
        gone.insert(d);
    }
    // Links to swept blobs: without them a HEAD would promise a blob that is gone.
    for (key, d) in layer_links {
        if gone.contains(&d) {
            report.links_removed += 1;
            if !opts.dry_run {
                store.delete(&key).await?;
            }
        }
    }

    // Expired upload sessions (state and parts), and orphaned parts.
    let mut sessions: BTreeMap<String, Vec<crate::store::ObjectMeta>> = BTreeMap::new();
    for m in store.list(layout::UPLOADS).await? {
        if let Some(id) = m.key.strip_prefix(layout::UPLOADS).and_then(|r| r.split('/').next()) {
            sessions.entry(id.to_owned()).or_default().push(m);
        }
    }
    for (id, objs) in sessions {
        let newest = objs.iter().map(|m| m.modified).max().unwrap_or(now);
        if now.duration_since(newest).unwrap_or_default() >= opts.upload_ttl {
            report.uploads_removed += 1;
            tracing::info!(%id, dry_run = opts.dry_run, "remove expired upload");
            if !opts.dry_run {
                for m in objs {
                    store.delete(&m.key).await?;
                }
            }
        }
    }
    Ok(report)
}
