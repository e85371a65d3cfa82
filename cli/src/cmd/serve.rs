//! `snapctl serve`: run the OCI registry (owned by the registry work; see registry/).

use std::process::ExitCode;

/// Run an OCI Distribution registry that stores snapshots content-addressed.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// Where blobs and manifests live: a directory, or s3://BUCKET/PREFIX.
    #[arg(long, default_value = "./snapctl-registry")]
    pub storage: String,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:5000")]
    pub listen: String,
}

pub fn run(_args: ServeArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("snapctl serve is not built yet")
}
