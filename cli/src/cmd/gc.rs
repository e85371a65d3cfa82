//! `snapctl gc`: retention, then mark and sweep of unreachable blobs, over a registry's
//! storage.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use imgfmt::size::human;
use registry::retention::Action;

use registry::config::{FileConfig, GcSection};

use super::common::{self, outln, parse_duration, printable};

/// Delete what retention lets go and the blobs no kept manifest reaches.
///
/// Retention first (spec/registry.md §4.1): every tag is kept unless a policy of --config
/// says otherwise (keep_tags), with what kept images need (index children, a snapshot's
/// base, referrers such as signatures and traces), and so is a manifest a running restore
/// holds a lease on (spec/registry.md §4.7); untagged manifests older than the delay
/// (default: --grace; after a lease, from its end) go, and referrers go with their
/// subject. Then marks from the
/// kept manifests (config, layers, index children) and deletes unmarked blobs older
/// than --grace that no request relied on (a HEAD that found it, a mount, an upload of the
/// same bytes, a manifest PUT) since --grace before gc started. Safe to run against live
/// servers, one gc at a time: a push running meanwhile keeps what it uploaded, re-tagged
/// or was told exists, or is refused cleanly (spec/registry.md §4). Upload sessions idle
/// for --upload-ttl go too. SIGTERM or SIGINT stops a run between two storage operations
/// and removes its marks (exit 2); what it deleted before stays deleted.
///
/// The report goes to stdout; --json prints one JSON object whose "retention" field holds
/// a verdict per tag and per manifest (keep or delete, the rule, the bytes that go).
///
/// Examples:
///   snapctl gc --storage /var/lib/snapctl --dry-run
///   snapctl gc --config /etc/snapctl/registry.toml --dry-run --json | jq '.retention.manifests[] | select(.action == "delete")'
///   snapctl gc --storage ./reg --grace 0s
#[derive(Debug, clap::Args)]
#[command(verbatim_doc_comment)]
pub struct GcArgs {
    /// The registry storage: a directory, or s3://BUCKET/PREFIX (default: storage in
    /// --config).
    #[arg(long)]
    pub storage: Option<String>,
    /// Configuration file of `serve` (TOML): storage, staging_dir, upload_ttl, [gc] grace,
    /// [retention] policies.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Keep unreferenced blobs younger than this (500ms, 90s, 15m, 1h30m, 7d; a plain
    /// number is seconds), or used by a request less than this before gc started; also
    /// the retention delay unless [retention] delay is set [default: 1h].
    #[arg(long, value_parser = parse_duration)]
    pub grace: Option<Duration>,
    /// Remove upload sessions idle for longer than this (same grammar as --grace)
    /// [default: 15m].
    #[arg(long, value_parser = parse_duration)]
    pub upload_ttl: Option<Duration>,
    /// Report what would be deleted; delete nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: GcArgs) -> anyhow::Result<ExitCode> {
    let file = FileConfig::load_opt(args.config.as_deref())?;
    let flags =
        FileConfig { storage: args.storage, upload_ttl: args.upload_ttl, gc: GcSection { grace: args.grace, ..GcSection::default() }, ..FileConfig::default() };
    let cfg = flags.over(file);
    let opts = cfg.gc_options(args.dry_run)?;
    let storage = cfg.gc_storage()?;
    for w in opts.retention.warnings() {
        eprintln!("warning: {w}");
    }
    let store = registry::store::open(storage, cfg.staging_dir.as_deref()).with_context(|| format!("opening storage {storage}"))?;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting tokio")?;
    let report = rt
        .block_on(async {
            // Taken before the run starts: a signal from here on stops the run cleanly.
            let stop = stop_signal()?;
            anyhow::Ok(registry::gc::run_until(store.as_ref(), &opts, stop).await?)
        })
        .context("gc")?;
    if args.json {
        common::print_json_line(&report)?;
        return Ok(ExitCode::SUCCESS);
    }
    let verb = if args.dry_run { "would delete" } else { "deleted" };
    let plan = &report.retention;
    if plan.dry_run && !args.dry_run {
        outln!("retention: dry run ([retention] dry_run = true): no tag or manifest deleted")?;
    }
    for v in plan.tags.iter().filter(|t| t.action == Action::Delete) {
        outln!("tag {verb}:      {}:{} ({})", printable(&v.repository), printable(&v.tag), rule_name(&v.rule))?;
    }
    for v in plan.manifests.iter().filter(|v| v.action == Action::Delete) {
        outln!(
            "manifest {verb}: {}@{} ({}; {} alone, {} shared)",
            printable(&v.repository),
            v.digest,
            rule_name(&v.rule),
            human(v.bytes),
            human(v.shared_bytes)
        )?;
    }
    outln!("manifests read:     {}", report.manifests)?;
    outln!("manifests {verb}: {}", report.manifests_removed)?;
    outln!("tags {verb}:     {}", report.tags_removed)?;
    outln!("blobs reachable:    {}", report.marked)?;
    outln!("blobs in storage:   {}", report.blobs)?;
    outln!("blobs {verb}: {} ({} bytes)", report.swept, report.swept_bytes)?;
    outln!("kept (in grace):    {}", report.kept_young)?;
    outln!("kept (in use):      {}", report.kept_in_use)?;
    outln!("links {verb}: {}", report.links_removed)?;
    outln!("referrer entries {verb}: {}", report.referrers_removed)?;
    outln!("uploads {verb}: {}", report.uploads_removed)?;
    Ok(ExitCode::SUCCESS)
}

/// Resolves on SIGTERM or SIGINT. The handlers are installed when this is called, so a
/// signal that arrives before the future is polled is not lost (nor does it kill the
/// process with the run's marks left behind).
fn stop_signal() -> anyhow::Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        eprintln!("snapctl gc: stopping, removing the run's marks");
    })
}

/// The rule's name as `--json` spells it.
fn rule_name(r: &registry::retention::Rule) -> String {
    serde_json::to_value(r).ok().and_then(|v| v["rule"].as_str().map(str::to_owned)).unwrap_or_default()
}
