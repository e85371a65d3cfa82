//! `snapctl gc`: mark and sweep unreachable blobs of a registry's storage.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;

pub(crate) fn duration(s: &str) -> Result<Duration, String> {
    registry::gc::parse_duration(s).ok_or_else(|| format!("invalid duration {s:?} (examples: 90s, 15m, 1h, 7d)"))
}

/// Delete blobs that no manifest reaches.
///
/// Marks from every manifest in every repository (config, layers, index children,
/// subject), then deletes unmarked blobs older than --grace, so a push running at the
/// same time keeps its freshly uploaded blobs. Safe to run against a live registry.
/// The report goes to stdout (JSON with --json).
#[derive(Debug, clap::Args)]
pub struct GcArgs {
    /// The registry storage: a directory, or s3://BUCKET/PREFIX.
    #[arg(long)]
    pub storage: String,
    /// Keep unreferenced blobs younger than this (90s, 15m, 1h, 7d).
    #[arg(long, default_value = "1h", value_parser = duration)]
    pub grace: Duration,
    /// Remove upload sessions idle for longer than this.
    #[arg(long, default_value = "24h", value_parser = duration)]
    pub upload_ttl: Duration,
    /// Report what would be deleted; delete nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: GcArgs) -> anyhow::Result<ExitCode> {
    let store = registry::store::open(&args.storage, None).with_context(|| format!("opening storage {}", args.storage))?;
    let opts = registry::gc::GcOptions { grace: args.grace, upload_ttl: args.upload_ttl, dry_run: args.dry_run };
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting tokio")?;
    let report = rt.block_on(registry::gc::run(store.as_ref(), &opts)).context("gc")?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        let verb = if args.dry_run { "would delete" } else { "deleted" };
        println!("manifests walked:   {}", report.manifests);
        println!("blobs reachable:    {}", report.marked);
        println!("blobs in storage:   {}", report.blobs);
        println!("blobs {verb}: {} ({} bytes)", report.swept, report.swept_bytes);
        println!("kept (in grace):    {}", report.kept_young);
        println!("links {verb}: {}", report.links_removed);
        println!("uploads {verb}: {}", report.uploads_removed);
    }
    Ok(ExitCode::SUCCESS)
}
