//! `snapctl cache`: what snapctl keeps on this host under the cache directory, and
//! pruning it; and the host cache's flags, declared here once for every command that
//! takes them:
//!
//! | flag | struct | taken by |
//! |---|---|---|
//! | `--cache DIR` | [`CacheDir`] | `cache`, `pull`, `lazy`, `mount` (`push` and `copy`: `push::TransferFlags`) |
//! | `--cache-size SIZE` | [`Budget`] | `cache`, `push`, `pull`, `lazy`, `mount` |
//! | `--no-cache` | [`HostCacheArgs`] | `pull`, `lazy`, `mount` |
//!
//! The defaults are the libraries': [`ChunkCache::default_dir`] and
//! [`puller::cache::DEFAULT_LIMIT`] (`$SNAPCTL_CACHE_SIZE` overrides it, through clap).

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::LazyLock;
use std::time::Duration;

use anyhow::Context;
use puller::cache::Usage;
use puller::ChunkCache;

use super::common::{self, outln, parse_size};

/// Show what snapctl keeps on this host, or prune it.
///
/// Everything snapctl keeps under the cache directory counts against one budget,
/// --cache-size (below), which pull, push, lazy and mount enforce as they go, least
/// recently used first:
///   chunks        chunk copies and references the pulls and lazy restores made
///   push-layouts  a packed copy of each pushed directory: its packs only until the
///                 registry has them, then the metadata the next layer is made over
///   uploads       resume state of interrupted uploads
///   known-blobs   which repositories hold which blobs (for cross-repository mounts)
/// Lazy-restore traces are not kept here: lazy stores each trace beside its image (a
/// referrer in the registry, or the layout's fallback tag). Nor are a running `snapctl
/// mount`'s whole-file copies (mount-files/) counted: they last only while their images
/// are mounted. A push layout a running push
/// holds, the chunks a running lazy restore pins (its image, so it does not depend on the
/// registry) and files being written are never evicted, not even by `prune --all`; pinned
/// chunks count toward the budget. Removing the directory by hand is safe while nothing
/// runs (the next commands fetch or pack again).
///
/// Prints one line per kind (bytes are allocated bytes, what fills the disk); --json: the
/// same as an object. Exit 0, or 2 if the cache could not be read.
///
/// Examples:
///   snapctl cache
///   snapctl cache --json | jq '.kinds[] | select(.kind == "push-layouts")'
///   snapctl cache prune --to 2GiB
///   snapctl cache prune --all
#[derive(Debug, clap::Args)]
#[command(verbatim_doc_comment, args_conflicts_with_subcommands = false)]
pub struct CacheArgs {
    #[command(subcommand)]
    pub cmd: Option<CacheCmd>,
    #[command(flatten)]
    pub common: CacheCommon,
}

#[derive(Debug, Clone, clap::Args)]
pub struct CacheCommon {
    #[command(flatten)]
    pub dir: CacheDir,
    #[command(flatten)]
    pub budget: Budget,
    /// Print JSON on stdout.
    #[arg(long, global = true)]
    pub json: bool,
}

#[derive(Debug, clap::Subcommand)]
pub enum CacheCmd {
    /// Evict least recently used entries (of every kind) until the cache holds at most
    /// --to bytes, or everything not in use with --all. Prints what is left, as `cache`
    /// does, and on stderr what went.
    Prune(PruneArgs),
}

#[derive(Debug, clap::Args)]
pub struct PruneArgs {
    /// Size to bring the cache down to [default: the budget, --cache-size].
    #[arg(long, value_name = "SIZE", value_parser = parse_size, conflicts_with = "all")]
    pub to: Option<u64>,
    /// Remove everything that is not in use.
    #[arg(long)]
    pub all: bool,
}

/// `--cache DIR`: the host cache directory.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct CacheDir {
    /// The host cache directory: chunks, push layouts, upload state, known blobs (see
    /// `snapctl cache`) [default: $SNAPCTL_CACHE, else $XDG_CACHE_HOME/snapctl, else
    /// ~/.cache/snapctl].
    #[arg(id = "cache", long = "cache", value_name = "DIR", global = true)]
    pub dir: Option<PathBuf>,
}

impl CacheDir {
    /// The directory named, else the host's default.
    pub fn path(&self) -> PathBuf {
        self.dir.clone().unwrap_or_else(ChunkCache::default_dir)
    }
}

/// `--cache-size SIZE`: the one budget on the cache directory, for every command that
/// adds to it.
#[derive(Debug, Clone, clap::Args)]
pub struct Budget {
    /// Bound on everything kept under the cache directory (chunks, push layouts, upload
    /// state, known blobs: see `snapctl cache`); least recently used entries are evicted.
    #[arg(long = "cache-size", value_name = "SIZE", value_parser = parse_size, default_value = default_size(), env = "SNAPCTL_CACHE_SIZE", global = true)]
    pub cache_size: u64,
}

/// `--cache-size`'s default as a flag is written: the chunk cache's own,
/// [`puller::cache::DEFAULT_LIMIT`].
pub fn default_size() -> &'static str {
    static TEXT: LazyLock<String> = LazyLock::new(|| imgfmt::size::flag(puller::cache::DEFAULT_LIMIT));
    &TEXT
}

/// The host cache of a command that reads chunks through it (`pull`, `lazy`, `mount`):
/// `--cache`, `--cache-size`, `--no-cache`.
#[derive(Debug, Clone, clap::Args)]
pub struct HostCacheArgs {
    #[command(flatten)]
    pub dir: CacheDir,
    #[command(flatten)]
    pub budget: Budget,
    /// Do without the chunk cache: every chunk comes from the image's source, and none is
    /// kept (so lazy and mount have nothing to fill).
    #[arg(long, conflicts_with = "cache")]
    pub no_cache: bool,
}

impl HostCacheArgs {
    /// The chunk cache the flags name, opened within its budget; `None` with --no-cache.
    pub fn open(&self) -> anyhow::Result<Option<ChunkCache>> {
        if self.no_cache {
            return Ok(None);
        }
        let dir = self.dir.path();
        let cache = ChunkCache::open(&dir, self.budget.cache_size).with_context(|| format!("opening the chunk cache in {}", dir.display()))?;
        Ok(Some(cache))
    }
}

pub fn run(a: CacheArgs) -> anyhow::Result<ExitCode> {
    let dir = a.common.dir.path();
    let limit = a.common.budget.cache_size;
    // Opened without a bound (nothing is evicted by looking), then told the budget for
    // the report.
    let mut cache = ChunkCache::open(&dir, u64::MAX).with_context(|| format!("opening the cache directory {}", dir.display()))?;
    if let Some(CacheCmd::Prune(p)) = &a.cmd {
        // A throttle for tests that kill a prune half-way; unset in real use.
        if let Some(ms) = std::env::var("SNAPCTL_EVICT_DELAY_MS").ok().and_then(|v| v.parse().ok()) {
            cache.set_evict_delay(Duration::from_millis(ms));
        }
        let to = if p.all { 0 } else { p.to.unwrap_or(limit) };
        let pruned = cache.prune(to).with_context(|| format!("pruning {}", dir.display()))?;
        eprintln!(
            "pruned {} entries ({}){}{}",
            pruned.entries_evicted,
            imgfmt::size::human(pruned.bytes_freed),
            if pruned.in_use_kept > 0 { format!("; {} in use kept", pruned.in_use_kept) } else { String::new() },
            if pruned.leftovers_removed > 0 { format!("; {} leftovers of interrupted evictions removed", pruned.leftovers_removed) } else { String::new() },
        );
    }
    let mut usage = cache.usage().with_context(|| format!("reading {}", dir.display()))?;
    usage.limit_bytes = limit;
    if a.common.json {
        common::print_json(&usage)?;
    } else {
        print_usage(&usage)?;
    }
    Ok(common::code(common::EXIT_OK))
}

fn print_usage(u: &Usage) -> anyhow::Result<()> {
    outln!("{}", u.dir.display())?;
    outln!("{:<14} {:>9} {:>11}", "kind", "entries", "bytes")?;
    for k in &u.kinds {
        let in_use = if k.in_use > 0 { format!("  ({} in use)", k.in_use) } else { String::new() };
        outln!("{:<14} {:>9} {:>11}{in_use}", k.kind.name(), k.entries, imgfmt::size::human(k.bytes))?;
    }
    outln!("{:<14} {:>9} {:>11}  of {} (--cache-size)", "total", u.total_entries, imgfmt::size::human(u.total_bytes), imgfmt::size::human(u.limit_bytes))?;
    if u.pins > 0 {
        outln!("{:<14} {:>9} {:>11}  chunks kept for {} running restore(s)", "pinned", "", imgfmt::size::human(u.pinned_bytes), u.pins)?;
    }
    Ok(())
}
