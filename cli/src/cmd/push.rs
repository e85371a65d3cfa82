//! `snapctl push`: an image (from a local layout, or a checkpoint directory packed on the
//! fly) goes to a repository of any OCI registry.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context};
use imgfmt::reference::{Reference, Selector};
use imgfmt::{BlobSource, OciDigest, OciLayout};
use pusher::{CopyOptions, PushReport};
use registry::client::{RegistrySource, UploadOptions};

use super::common::{self, progress_bar, IntegrityError};
use super::pack::PackFlags;

/// Push an image to an OCI registry.
///
/// SRC is a local image (oci:PATH[:TAG]) or a checkpoint directory, which is packed on the
/// fly (same options as `pack`) into a layout under the cache directory, so re-pushing an
/// unchanged directory only asks the registry what it has. Blobs the repository has are
/// skipped, blobs other repositories of the registry hold are mounted (--mount-from, and
/// a record of where this host pushed and pulled blobs), the rest are uploaded in
/// parallel; large packs go up in resumable pieces, so rerunning an interrupted push
/// continues where it stopped. Prints the manifest digest (--json: a report).
///
/// Credentials come from ~/.docker/config.json (see `snapctl login`). Plain HTTP is used
/// for 127.0.0.1/localhost, with --plain-http, or with SNAPCTL_PLAIN_HTTP=1.
///
/// Examples:
///   snapctl push oci:./images:vm1 registry.example.com/sandboxes/vm1:v1
///   snapctl push ./fc-snap 127.0.0.1:5000/vm/base
///   snapctl push ./fc-snap-2 127.0.0.1:5000/vm/next:v2 --parent oci:./images:vm1 --mount-from vm/base
///   snapctl push oci:./images:vm1 127.0.0.1:5000/vm/base --json | jq .bytes_sent
#[derive(Debug, clap::Args)]
#[command(verbatim_doc_comment)]
pub struct PushArgs {
    /// Source: oci:PATH[:TAG|@DIGEST], or a checkpoint directory.
    pub src: String,
    /// Destination: HOST[:PORT]/REPO[:TAG] (TAG defaults to "latest").
    pub dest: String,
    #[command(flatten)]
    pub transfer: TransferFlags,
    #[command(flatten)]
    pub pack: PackFlags,
}

/// Options shared by `push` and `copy`.
#[derive(Debug, Clone, clap::Args)]
pub struct TransferFlags {
    /// Blobs moved at once.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub jobs: u16,
    /// Try mounting blobs from this repository of the same registry first (repeatable).
    #[arg(long, value_name = "REPO")]
    pub mount_from: Vec<String>,
    /// Upload piece: blobs up to this size go in one request, larger ones in PATCHes of
    /// this size (or the registry's OCI-Chunk-Min-Length, if larger).
    #[arg(long, default_value = "16MiB", value_parser = common::parse_size)]
    pub upload_piece: u64,
    /// Speak plain HTTP to the registry (default for 127.0.0.1 and localhost).
    #[arg(long)]
    pub plain_http: bool,
    /// Cache directory (resume state, where blobs were seen, packed directories)
    /// [default: $SNAPCTL_CACHE, $XDG_CACHE_HOME/snapctl or ~/.cache/snapctl].
    #[arg(long, value_name = "DIR")]
    pub cache: Option<PathBuf>,
    /// Print a JSON report on stdout instead of the manifest digest.
    #[arg(long)]
    pub json: bool,
}

impl TransferFlags {
    pub fn cache_dir(&self) -> PathBuf {
        self.cache.clone().unwrap_or_else(registry::client::cache_dir)
    }
}

/// A client for `host`/`repository`: plain HTTP when asked or local, credentials from
/// Docker's config.
pub fn registry_client(host: &str, repository: &str, plain_http: bool) -> anyhow::Result<RegistrySource> {
    let plain = plain_http || std::env::var_os("SNAPCTL_PLAIN_HTTP").is_some_and(|v| v == "1") || registry::client::is_loopback(host);
    let creds = registry::client::docker_config_credentials(host);
    RegistrySource::new(host, repository, plain, creds).with_context(|| format!("connecting to {host}"))
}

/// Move `digest` from `src` to `target` with a progress bar on a terminal, then print the
/// digest or the report. Errors where content failed its digest exit 1.
pub fn transfer(
    src: &dyn BlobSource,
    digest: &OciDigest,
    target: &pusher::Target,
    tag: Option<&str>,
    flags: &TransferFlags,
    verb: &str,
) -> anyhow::Result<PushReport> {
    let (_, manifest) = pusher::copy::manifest_blobs(src, digest).map_err(|e| wrap(e, verb))?;
    let total: u64 = std::iter::once(&manifest.config).chain(&manifest.layers).map(|d| d.size).sum();
    let pb = progress_bar(total, verb);
    let tick = |n: u64| {
        if let Some(pb) = &pb {
            pb.inc(n)
        }
    };
    if flags.upload_piece == 0 {
        bail!("--upload-piece must be at least 1 byte");
    }
    let opts = CopyOptions {
        jobs: flags.jobs as usize,
        mount_from: flags.mount_from.clone(),
        upload: UploadOptions { piece: flags.upload_piece.min(registry::client::MAX_PIECE), cache_dir: Some(flags.cache_dir()) },
        progress: Some(&tick),
    };
    let report = pusher::copy(src, digest, target, tag, &opts).map_err(|e| wrap(e, verb))?;
    if let Some(pb) = pb {
        pb.finish_and_clear();
    }
    if flags.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!("{}", report.manifest);
        eprintln!(
            "{verb}: {} blobs to {} ({} already there, {} mounted, {} uploaded): {} sent of {}{} in {:.2}s",
            report.blobs_total,
            report.destination,
            report.blobs_skipped,
            report.blobs_mounted,
            report.blobs_uploaded,
            imgfmt::size::human(report.bytes_sent),
            imgfmt::size::human(report.bytes_total),
            if report.bytes_resumed > 0 { format!(" (resumed: {} were already uploaded)", imgfmt::size::human(report.bytes_resumed)) } else { String::new() },
            report.seconds
        );
    }
    Ok(report)
}

fn wrap(e: pusher::CopyError, verb: &str) -> anyhow::Error {
    if e.is_integrity() {
        anyhow::Error::new(IntegrityError(format!("{verb}: {e}")))
    } else {
        anyhow::Error::new(e).context(verb.to_string())
    }
}

pub fn run(a: PushArgs) -> anyhow::Result<ExitCode> {
    let (host, repository, tag) = match a.dest.parse::<Reference>()? {
        Reference::Registry { host, repository, selector: Selector::Tag(t) } => (host, repository, t),
        Reference::Registry { .. } => bail!("{}: push needs a tag (HOST/REPO:TAG), not a digest", a.dest),
        Reference::Layout { .. } => bail!("{}: push sends to a registry (HOST[:PORT]/REPO[:TAG]); for a local layout use `snapctl copy`", a.dest),
    };
    let dest = registry_client(&host, &repository, a.transfer.plain_http)?;
    let (layout, digest) = if a.src.starts_with("oci:") {
        let Reference::Layout { path, selector } = a.src.parse::<Reference>()? else { unreachable!("oci: prefix") };
        let layout = OciLayout::open(&path).with_context(|| format!("opening {}", a.src))?;
        let d = match selector {
            Selector::Tag(t) => layout.resolve_tag(&t).with_context(|| format!("resolving {}", a.src))?,
            Selector::Digest(d) => d,
        };
        (layout, d)
    } else if !Path::new(&a.src).exists() && matches!(a.src.parse::<Reference>(), Ok(Reference::Registry { .. })) {
        bail!("{}: push sends a local image or directory; to move an image from one registry to another use `snapctl copy {} {}`", a.src, a.src, a.dest);
    } else {
        pack_directory(Path::new(&a.src), &a.pack, &a.transfer.cache_dir())?
    };
    transfer(&layout, &digest, &pusher::Target::Registry(&dest), Some(&tag), &a.transfer, "push")?;
    Ok(common::code(common::EXIT_OK))
}

/// Pack a directory into a layout of its own under the cache directory (one per source
/// path). When the content is unchanged since the last push (same index and packs: only
/// the creation time would differ), the earlier manifest is used again, so the registry
/// is only asked what it has and nothing is sent.
fn pack_directory(dir: &Path, flags: &PackFlags, cache: &Path) -> anyhow::Result<(OciLayout, OciDigest)> {
    super::pack::validate(dir, flags)?;
    let canon = dir.canonicalize().with_context(|| format!("resolving {}", dir.display()))?;
    let key = OciDigest::of(canon.as_os_str().as_encoded_bytes());
    let root = cache.join("push-layouts").join(&key.hex()[..32]);
    let layout = OciLayout::open_or_create(&root).with_context(|| format!("opening {}", root.display()))?;
    let previous = layout.resolve_tag("previous").ok();
    let report = super::pack::pack_into(dir, &layout, "latest", flags)?;
    for s in &report.skipped {
        eprintln!("warning: skipped {s}: not a regular file");
    }
    let new: OciDigest = report.manifest.parse()?;
    if let Some(old) = previous.filter(|o| o != &new) {
        let same = |d: &OciDigest| imgfmt::source::read_verified_blob(&layout, d, imgfmt::manifest::MAX_MANIFEST_BYTES).ok().and_then(|b| imgfmt::Manifest::decode(&b).ok());
        if let (Some(a), Some(b)) = (same(&old), same(&new)) {
            if a.layers == b.layers && a.config.media_type == b.config.media_type {
                eprintln!("{}: unchanged since the last push", dir.display());
                return Ok((layout, old));
            }
        }
    }
    let desc = imgfmt::Descriptor::new(imgfmt::media::OCI_MANIFEST, new.clone(), layout.blob_size(&new)?);
    layout.set_tag("previous", desc)?;
    Ok((layout, new))
}
