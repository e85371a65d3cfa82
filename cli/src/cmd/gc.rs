//! `snapctl gc`: mark and sweep unreachable blobs of a registry's storage.

use std::process::ExitCode;

/// Delete blobs that no manifest reaches.
#[derive(Debug, clap::Args)]
pub struct GcArgs {
    /// The registry storage: a directory, or s3://BUCKET/PREFIX.
    #[arg(long)]
    pub storage: String,
}

pub fn run(_args: GcArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("snapctl gc is not built yet")
}
