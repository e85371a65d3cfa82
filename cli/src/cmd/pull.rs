//! `snapctl pull`: a registry image becomes checkpoint files on this host, through the
//! per-host chunk cache.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use puller::PullOptions;

use super::common::{self, parse_size};

/// Pull an image from a registry into a directory (the wake path of a sandbox).
///
/// Fetches manifest, config and index and checks them against the digest given or the tag
/// resolved; then fetches only the chunks the per-host chunk cache lacks, by byte-range
/// reads of the packs (neighbours coalesced, several requests in parallel), verifies every
/// chunk before it is written, and leaves zero chunks as holes. Each file appears under
/// its name only when complete and synced. The cache then records where each fetched
/// chunk is in the pulled files (re-hashed whenever read), so a later pull of a layer over
/// this image fetches only the delta while these files exist; --cache-copy keeps copies
/// instead (they survive deleting the files; every byte is written twice). A pull killed
/// or cut off by the network and rerun into the same directory takes over what it wrote
/// and fetches only the rest; a file already under its name that holds exactly the
/// image's content (checked whole) is kept. Names are written beneath DEST only: a
/// symlink found there is never followed. Modes are applied less set-uid/set-gid/sticky
/// bits and write for others.
///
/// Exit 0 ok, 1 a chunk or metadata blob failed verification (no file of it is left under
/// its final name), 2 error.
///
/// Examples:
///
///   snapctl pull 127.0.0.1:5000/vm/web:v3 ./restore
///
///   snapctl pull registry.example.com/vm/web@sha256:... /srv/vm --jobs 16 --json
///
///   snapctl pull localhost:5000/vm/web ./r --cache /var/cache/snapctl --cache-size 50GiB
///
///   snapctl pull localhost:5000/vm/web:v3 oci:./images:web-v3
#[derive(Debug, clap::Args)]
#[command(verbatim_doc_comment)]
pub struct PullArgs {
    /// Image: HOST[:PORT]/REPO[:TAG|@DIGEST] (or oci:PATH[:TAG|@DIGEST]). Credentials from
    /// ~/.docker/config.json.
    pub image: String,
    /// Destination directory (created if missing), or `oci:PATH[:TAG]` to copy the image
    /// into a local layout, digests kept (as `snapctl copy` does; cache options do not apply).
    pub dest: String,
    #[command(flatten)]
    pub cache: super::cache::HostCacheArgs,
    /// Keep a copy of every fetched chunk in the cache, rather than a reference into the
    /// pulled files: slower (every byte written twice), but the cache then serves later
    /// pulls and lazy restores even after these files are deleted or changed.
    #[arg(long, conflicts_with = "no_cache")]
    pub cache_copy: bool,
    /// Range requests in flight from the start (and threads reading the cache).
    #[arg(long, short = 'j', default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub jobs: u16,
    /// Range requests in flight at most: once a round trip to the registry is timed, pull
    /// keeps as many in flight as a 10 Gbit/s link at that round-trip time needs (within
    /// 256 MiB of ranges, and never fewer than --jobs).
    #[arg(long, value_name = "N", default_value_t = puller::DEFAULT_MAX_JOBS as u16, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub max_jobs: u16,
    /// Largest coalesced range request (neighbouring chunks of a pack are fetched together
    /// up to this many stored bytes).
    #[arg(long, value_name = "SIZE", value_parser = parse_size, default_value = "8MiB")]
    pub max_range: u64,
    /// Replace files that already exist in the destination.
    #[arg(long)]
    pub overwrite: bool,
    #[command(flatten)]
    pub registry: super::common::RegistryFlags,
    /// Print the pull report as JSON on stdout.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub policy: super::policy::PolicyFlags,
}

pub fn run(a: PullArgs) -> anyhow::Result<ExitCode> {
    if a.dest.starts_with("oci:") {
        // Into a layout the image is copied blob for blob, digests kept: that is `copy`.
        let flags = super::push::TransferFlags {
            jobs: a.jobs.min(64),
            mount_from: Vec::new(),
            sign_key: None,
            upload_piece: 16 << 20,
            registry: a.registry.clone(),
            cache: Default::default(),
            json: a.json,
        };
        super::copy::copy_refs(&a.image, &a.dest, &flags, &a.policy)?;
        return Ok(common::code(common::EXIT_OK));
    }
    let dest = PathBuf::from(&a.dest);
    let (o, image) = a.policy.open_image(&a.image)?;
    let cache = a.cache.open()?;
    // The bar counts the data to fetch (from the registry, the cache or a file in place);
    // zero chunks are holes, written by nobody.
    let pb = common::download_progress_bar(puller::data_bytes(&image), "pull");
    let tick = |n: u64| {
        if let Some(pb) = &pb {
            pb.inc(n)
        }
    };
    // A throttle for tests and demos that interrupt a pull; unset in real use.
    let delay = std::env::var("SNAPCTL_PULL_DELAY_MS").ok().and_then(|v| v.parse().ok()).map(Duration::from_millis).unwrap_or_default();
    let opts = PullOptions {
        jobs: a.jobs as usize,
        max_jobs: a.max_jobs as usize,
        overwrite: a.overwrite,
        max_range: a.max_range,
        request_delay: delay,
        cache_copies: a.cache_copy,
    };
    let report = puller::pull(o.source.as_ref(), &image, &dest, cache.as_ref(), &opts, Some(&tick))
        .with_context(|| format!("pulling {} into {}", a.image, dest.display()))?;
    if let Some(pb) = pb {
        pb.finish_and_clear();
    }
    if a.json {
        common::print_json(&report)?;
    }
    eprintln!(
        "pulled {} files, {} in {:.2}s: fetched {} in {} requests ({} chunks), {} chunks from cache, {} resumed, {} deduplicated, {} zero",
        report.files,
        imgfmt::size::human(report.logical_bytes),
        report.seconds,
        imgfmt::size::human(report.bytes_fetched),
        report.range_requests,
        report.fetched_chunks,
        report.cached_chunks,
        report.resumed_chunks,
        report.deduplicated_chunks,
        report.zero_chunks,
    );
    if report.in_place_files > 0 {
        eprintln!("note: {} files were already in place with the image's content (checked whole) and were kept", report.in_place_files);
    }
    if report.range_retries > 0 {
        eprintln!("note: {} range requests failed mid-transfer and were repeated", report.range_retries);
    }
    if report.refetched_chunks > 0 {
        eprintln!("note: {} chunks failed verification in transit and were fetched again", report.refetched_chunks);
    }
    if report.cache_put_errors > 0 {
        eprintln!("warning: {} chunks could not be added to the cache", report.cache_put_errors);
    }
    Ok(common::code(common::EXIT_OK))
}
