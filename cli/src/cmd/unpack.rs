//! `snapctl unpack`: an image becomes checkpoint files again.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use puller::UnpackOptions;

use super::common::{self, progress_bar};

/// Write an image's files into a directory.
///
/// Every chunk is verified before it is written; zero chunks become holes (sparse
/// files); each file is written under a temporary name, synced, then renamed, so a file
/// under its final name is always complete. Exit 1 if a chunk fails verification.
#[derive(Debug, clap::Args)]
pub struct UnpackArgs {
    /// Image: oci:PATH[:TAG|@DIGEST] or HOST[:PORT]/REPO[:TAG|@DIGEST] (plain HTTP for loopback
    /// hosts or with SNAPCTL_PLAIN_HTTP=1; credentials from ~/.docker/config.json).
    pub image: String,
    /// Destination directory (created if missing).
    pub dest: PathBuf,
    /// Replace files that already exist in the destination.
    #[arg(long)]
    pub overwrite: bool,
    #[command(flatten)]
    pub registry: super::common::RegistryFlags,
    /// Print a JSON report on stdout.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub policy: super::policy::PolicyFlags,
}

pub fn run(a: UnpackArgs) -> anyhow::Result<ExitCode> {
    let (o, image) = a.policy.open_image(&a.image)?;
    let total = image.files.iter().map(|f| f.size).sum();
    let pb = progress_bar(total, "unpack");
    let tick = |n: u64| {
        if let Some(pb) = &pb {
            pb.inc(n)
        }
    };
    let opts = UnpackOptions { overwrite: a.overwrite, ..Default::default() };
    let report =
        puller::unpack(o.source.as_ref(), &image, &a.dest, &opts, Some(&tick)).with_context(|| format!("unpacking {} into {}", a.image, a.dest.display()))?;
    if let Some(pb) = pb {
        pb.finish_and_clear();
    }
    if a.json {
        common::print_json(&report)?;
    } else {
        eprintln!(
            "unpacked {} files, {} ({} written, {} zero chunks as holes) in {:.2}s",
            report.files,
            imgfmt::size::human(report.logical_bytes),
            imgfmt::size::human(report.bytes_written),
            report.zero_chunks,
            report.seconds
        );
    }
    Ok(common::code(common::EXIT_OK))
}
