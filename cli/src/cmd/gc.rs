//! `snapctl gc`: mark and sweep unreachable blobs of a registry's storage.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;

use super::common::{self, outln, parse_duration};

/// Delete blobs that no manifest reaches.
///
/// Marks from every manifest in every repository (config, layers, index children,
/// subject), then deletes unmarked blobs older than --grace that no request relied on
/// (a HEAD that found it, a mount, an upload of the same bytes, a manifest PUT) since
/// --grace before gc started. Safe to run against live servers, one gc at a time: a
/// push running meanwhile keeps what it uploaded or was told exists, or is refused
/// cleanly (spec/registry.md §4). Upload sessions idle for --upload-ttl go too.
/// The report goes to stdout (JSON with --json).
#[derive(Debug, clap::Args)]
pub struct GcArgs {
    /// The registry storage: a directory, or s3://BUCKET/PREFIX.
    #[arg(long)]
    pub storage: String,
    /// Keep unreferenced blobs younger than this, or used by a request less than this
    /// before gc started (500ms, 90s, 15m, 1h30m, 7d; a plain number is seconds).
    #[arg(long, default_value = "1h", value_parser = parse_duration)]
    pub grace: Duration,
    /// Remove upload sessions idle for longer than this (same grammar as --grace).
    #[arg(long, default_value = "15m", value_parser = parse_duration)]
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
        common::print_json_line(&report)?;
    } else {
        let verb = if args.dry_run { "would delete" } else { "deleted" };
        outln!("manifests walked:   {}", report.manifests)?;
        outln!("blobs reachable:    {}", report.marked)?;
        outln!("blobs in storage:   {}", report.blobs)?;
        outln!("blobs {verb}: {} ({} bytes)", report.swept, report.swept_bytes)?;
        outln!("kept (in grace):    {}", report.kept_young)?;
        outln!("kept (in use):      {}", report.kept_in_use)?;
        outln!("links {verb}: {}", report.links_removed)?;
        outln!("uploads {verb}: {}", report.uploads_removed)?;
    }
    Ok(ExitCode::SUCCESS)
}
