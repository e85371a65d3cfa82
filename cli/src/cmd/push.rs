//! `snapctl push`: an image (from a local layout, or a checkpoint directory packed on the
//! fly) goes to a repository of any OCI registry.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context as _};
use imgfmt::reference::{Reference, Selector};
use imgfmt::{BlobSource, OciDigest};
use pusher::push::Reused;
use pusher::{CopyOptions, PushReport};
use regclient::UploadOptions;

use super::common::{self, outln, IntegrityError};
use super::pack::PackFlags;

/// Push an image to an OCI registry.
///
/// SRC is a local image (oci:PATH[:TAG]) or a checkpoint directory, which is packed on the
/// fly (same options as `pack`) into a layout under the cache directory, so re-pushing an
/// unchanged directory only asks the registry what it has. Blobs the repository has are
/// skipped, blobs other repositories of the registry hold are mounted (--mount-from, and
/// a record of where this host pushed and pulled blobs), the rest are uploaded in
/// parallel; large packs go up in resumable pieces, so rerunning an interrupted push
/// continues where it stopped. With --parent, a layer whose chain would pass --max-chain
/// is rebased onto packs the registry already has (see `snapctl pack --help`; --json
/// says so in .pack.rebased and .pack.chain_depth). Prints the manifest digest (--json:
/// a report).
///
/// Pushing a directory makes a layer over the closest image already in the repository, by
/// itself, so only the chunks that changed go up, whatever the new tag is called: among
/// the destination tag and the last 32 other tags (in the registry's order), the images of
/// the same files (the same kind, chunk size and hash, and the same file names), the one
/// this directory was last pushed as first, else the newest, confirmed by comparing a
/// sample of 32 chunks. stderr names the parent and why, or why none was taken; --parent
/// names one, --no-parent pushes a full image. A push keeps a packed copy of the directory under the cache
/// directory only until the registry has it: then its packs are dropped, and what is
/// left (the metadata the next layer reads) counts against --cache-size with everything
/// else there (see `snapctl cache`).
///
/// --sign-key signs the pushed manifest in the same step, as `snapctl sign` does.
///
/// Credentials come from ~/.docker/config.json (see `snapctl login`). Plain HTTP is used
/// for 127.0.0.1/localhost, with --plain-http, or with SNAPCTL_PLAIN_HTTP=1.
///
/// Examples:
///   snapctl push oci:./images:vm1 registry.example.com/sandboxes/vm1:v1
///   snapctl push ./fc-snap 127.0.0.1:5000/vm/base
///   snapctl push ./fc-snap-2 127.0.0.1:5000/vm/next:v2 --parent oci:./images:vm1 --mount-from vm/base
///   snapctl push ./fc-snap 127.0.0.1:5000/vm/sandbox:h-20261207T1500 --sign-key cosign.key
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
    #[command(flatten)]
    pub budget: super::cache::Budget,
}

/// Options shared by `push` and `copy`.
#[derive(Debug, Clone, clap::Args)]
pub struct TransferFlags {
    /// Blobs moved at once.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub jobs: u16,
    /// Try mounting blobs from this repository of the same registry first (repeatable).
    /// Without it, blobs are mounted from the repositories this host's record of earlier
    /// pushes, copies and pulls names for them; a registry that declines a mount gets
    /// the blob uploaded, and stderr says so once.
    #[arg(long, value_name = "REPO")]
    pub mount_from: Vec<String>,
    /// Sign the manifest once it is in place, as `snapctl sign --key FILE` does (cosign's
    /// encrypted private key; password from $COSIGN_PASSWORD or a prompt), certifying the
    /// destination as named (HOST/REPO:TAG). Registry destinations only [default: not
    /// signed].
    #[arg(long, value_name = "FILE")]
    pub sign_key: Option<PathBuf>,
    /// Upload piece: blobs up to this size go in one request, larger ones in PATCHes of
    /// this size (or the registry's OCI-Chunk-Min-Length, if larger).
    #[arg(long, default_value = "16MiB", value_parser = common::parse_size)]
    pub upload_piece: u64,
    #[command(flatten)]
    pub registry: super::common::RegistryFlags,
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
        self.cache.clone().unwrap_or_else(regclient::cache_dir)
    }
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
    transfer_then(src, digest, target, tag, flags, verb, |_, _| Ok(()))
}

/// Why `--sign-key` refuses a layout destination.
pub const NO_NAME_TO_SIGN: &str = "--sign-key: a layout has no registry name to certify; sign it with `snapctl sign --identity HOST/REPO:TAG`";

/// What `--sign-key` signs with, and the name it certifies.
pub struct Signing<'a> {
    store: &'a dyn imgfmt::ImageStore,
    identity: String,
    key: sign::PrivateKey,
}

impl<'a> Signing<'a> {
    /// The signing step of a transfer to `target` as `tag` (or by `digest` alone), when
    /// `flags` ask for one: the key is read (and its password asked) now, before anything
    /// is sent.
    pub fn for_target(target: &'a pusher::Target, tag: Option<&str>, digest: Option<&OciDigest>, flags: &TransferFlags) -> anyhow::Result<Option<Signing<'a>>> {
        let Some(path) = &flags.sign_key else { return Ok(None) };
        let pusher::Target::Registry(r) = target else { bail!("{NO_NAME_TO_SIGN}") };
        let identity = match (tag, digest) {
            (Some(t), _) => format!("{}/{}:{t}", r.host(), r.repository()),
            (None, Some(d)) => format!("{}/{}@{d}", r.host(), r.repository()),
            (None, None) => bail!("--sign-key: nothing names the image to certify"),
        };
        Ok(Some(Signing { store: *r, identity, key: super::sign::load_private_key(path)? }))
    }
}

/// [`transfer`], and `then` (which may add to the report: `copy` carries referrers) before
/// the report is printed.
pub fn transfer_then(
    src: &dyn BlobSource,
    digest: &OciDigest,
    target: &pusher::Target,
    tag: Option<&str>,
    flags: &TransferFlags,
    verb: &str,
    then: impl FnOnce(&CopyOptions, &mut PushReport) -> Result<(), pusher::CopyError>,
) -> anyhow::Result<PushReport> {
    let signing = Signing::for_target(target, tag, Some(digest), flags)?;
    with_progress(src, digest, flags, verb, signing, |opts| {
        let mut report = pusher::copy::copy_after(src, digest, target, tag, opts, &[])?;
        then(opts, &mut report)?;
        Ok(report)
    })
}

/// Run `send` (which moves manifest `digest` of `src`) with a progress bar on a terminal,
/// sign what arrived when `signing` says so, then print the digest or the report.
fn with_progress(
    src: &dyn BlobSource,
    digest: &OciDigest,
    flags: &TransferFlags,
    verb: &str,
    signing: Option<Signing<'_>>,
    send: impl FnOnce(&CopyOptions) -> Result<PushReport, pusher::CopyError>,
) -> anyhow::Result<PushReport> {
    let (_, manifest) = pusher::copy::manifest_blobs(src, digest).map_err(|e| wrap(e, verb))?;
    let total: u64 = std::iter::once(&manifest.config).chain(&manifest.layers).map(|d| d.size).sum();
    let pb = common::network_progress_bar(total, verb);
    let tick = |n: u64| {
        if let Some(pb) = &pb {
            pb.inc(n)
        }
    };
    if flags.upload_piece == 0 {
        bail!("--upload-piece must be at least 1 byte");
    }
    let mut opts = copy_options(flags);
    opts.progress = Some(&tick);
    let mut report = send(&opts).map_err(|e| wrap(e, verb))?;
    if let Some(pb) = pb {
        pb.finish_and_clear();
    }
    if report.mounts_declined > 0 {
        eprintln!(
            "{verb}: the registry declined to mount {} blob(s) from the other repositories recorded as holding them (no pull access there, or gone since): uploaded instead",
            report.mounts_declined
        );
    }
    if let Some(s) = signing {
        let signed = super::sign::sign_image(s.store, digest, &s.identity, &s.key, true).with_context(|| format!("{verb}: signing {}", s.identity))?;
        super::sign::say_signed(&signed, digest, &s.identity);
        report.signature = Some(signed);
    }
    if flags.json {
        common::print_json(&report)?;
    } else {
        outln!("{}", report.manifest)?;
        eprintln!(
            "{verb}: {} blobs to {} ({} already there, {} mounted, {} uploaded): {} sent of {}{} in {:.2}s",
            report.blobs,
            report.destination,
            report.skipped_blobs,
            report.mounted_blobs,
            report.uploaded_blobs,
            imgfmt::size::human(report.bytes_sent),
            imgfmt::size::human(report.bytes_total),
            if report.bytes_resumed > 0 { format!(" (resumed: {} were already uploaded)", imgfmt::size::human(report.bytes_resumed)) } else { String::new() },
            report.seconds
        );
    }
    Ok(report)
}

fn copy_options(flags: &TransferFlags) -> CopyOptions<'static> {
    CopyOptions {
        jobs: flags.jobs as usize,
        mount_from: flags.mount_from.clone(),
        upload: UploadOptions { piece: flags.upload_piece.min(regclient::MAX_PIECE), cache_dir: Some(flags.cache_dir()), source_hashed: false },
        progress: None,
    }
}

fn wrap(e: pusher::CopyError, verb: &str) -> anyhow::Error {
    if e.is_integrity() {
        anyhow::Error::new(IntegrityError(format!("{verb}: {e}")))
    } else {
        anyhow::Error::new(e).context(verb.to_string())
    }
}

/// The image of the destination repository a new image of `dir` is made over when no
/// parent is named ([`pusher::closest`]); stderr says why none is taken.
fn closest_parent<'a>(
    dir: &Path,
    dest: &regclient::RegistrySource,
    source: &'a dyn BlobSource,
    flags: &PackFlags,
    tag: &str,
    cache_dir: &Path,
) -> Option<super::pack::TagImage<'a>> {
    let opts = pusher::PackOptions { kind: flags.kind, chunk_shift: flags.chunk_size.trailing_zeros() as u8, hash: flags.hash, ..Default::default() };
    let last = pusher::push::last_packed(dir, cache_dir);
    let search = pusher::closest::closest_image(dest, source, dir, &opts, tag, last.as_ref(), pusher::closest::DEFAULT_CANDIDATES);
    let Some(c) = search.chosen else {
        eprintln!("no parent: {}; pushing a full image (--parent REF names one)", search.none_because);
        return None;
    };
    Some(super::pack::TagImage {
        source,
        digest: c.digest,
        reference: format!("{}/{}:{}", dest.host(), dest.repository(), c.tag),
        elsewhere: true,
        why: Some(c.why),
    })
}

pub fn run(a: PushArgs) -> anyhow::Result<ExitCode> {
    let r: Reference = a.dest.parse()?;
    let Some((host, repository)) = r.registry() else {
        bail!("{}: push sends to a registry (HOST[:PORT]/REPO[:TAG]); for a local layout use `snapctl copy`", a.dest)
    };
    let Selector::Tag(tag) = r.selector() else { bail!("{}: push needs a tag (HOST/REPO:TAG), not a digest", a.dest) };
    let dest = common::registry_client(host, repository)?;
    if a.src.starts_with("oci:") {
        let layout = common::open_ref(&a.src)?;
        let digest = common::resolve(&layout)?;
        transfer(layout.source.as_ref(), &digest, &pusher::Target::Registry(&dest), Some(tag), &a.transfer, "push")?;
        super::cache::keep_within_budget(&a.transfer.cache_dir(), a.budget.cache_size);
    } else if !Path::new(&a.src).exists() && a.src.parse::<Reference>().is_ok_and(|r| r.host().is_some()) {
        bail!("{}: push sends a local image or directory; to move an image from one registry to another use `snapctl copy {} {}`", a.src, a.src, a.dest);
    } else {
        let dir = Path::new(&a.src);
        super::pack::validate(dir, &a.pack)?;
        let cache_dir = a.transfer.cache_dir();
        // The metadata of the image pushed last from this directory is in its push layout:
        // read there, not fetched again.
        let local_first = pusher::push::LocalFirst::new(dir, &cache_dir, &dest);
        let target = pusher::Target::Registry(&dest);
        let signing = Signing::for_target(&target, Some(tag), None, &a.transfer)?;
        let held = match (&a.pack.parent, a.pack.no_parent) {
            (None, false) => closest_parent(dir, &dest, &local_first, &a.pack, tag, &cache_dir),
            _ => None,
        };
        // A --parent in the repository pushed to has its packs there as well.
        let parent_here = a.pack.parent.as_deref().and_then(|p| p.parse::<Reference>().ok()).is_some_and(|r| r.registry() == Some((host, repository)));
        let packed = super::pack::with_pack_options(dir, &a.pack, held, |mut pack, from_tag| {
            pack.parent_packs_elsewhere |= parent_here;
            let opts = pusher::DirOptions {
                pack,
                // Another version or other options pack differently: a stamp recorded
                // under another key is not trusted.
                options_key: format!("snapctl {} {:?}", env!("CARGO_PKG_VERSION"), a.pack),
                cache_dir: cache_dir.clone(),
                parent_is_the_tags: from_tag,
            };
            // Packs go up while the next is made: their bytes are counted on a line of
            // their own, under the packing bar.
            let sent = common::upload_counter("upload");
            let tick = |n: u64| {
                if let Some(pb) = &sent {
                    pb.inc(n)
                }
            };
            let mut copy = copy_options(&a.transfer);
            copy.progress = Some(&tick);
            let packed = pusher::push::pack_dir(dir, &dest, opts, &copy).map_err(anyhow::Error::new);
            if let Some(pb) = sent {
                pb.finish_and_clear();
            }
            packed
        })?;
        match packed.reused {
            Some(Reused::Stamp) => eprintln!("{}: unchanged since it was last packed (same stamp): not packing again", dir.display()),
            Some(Reused::Parent) => eprintln!("{}: unchanged: the parent already holds this content (its manifest is pushed as it is)", dir.display()),
            Some(Reused::Previous) | None => {
                for s in packed.report.iter().flat_map(|r| &r.skipped) {
                    eprintln!("warning: skipped {s}: not a regular file");
                }
                if packed.reused == Some(Reused::Previous) {
                    eprintln!("{}: unchanged since the last push", dir.display());
                }
            }
        }
        if let Some(r) = &packed.report {
            for line in super::pack::rebase_note(r, a.pack.max_chain).into_iter().chain(super::pack::compaction_note(r)) {
                eprintln!("{line}");
            }
        }
        with_progress(&packed.layout, &packed.digest, &a.transfer, "push", signing, |opts| pusher::push::push_packed(&packed, &dest, tag, opts))?;
        // The layout is released (a later eviction may take it); then everything under the
        // cache directory is brought within the budget.
        drop(packed);
        super::cache::keep_within_budget(&cache_dir, a.budget.cache_size);
    }
    Ok(common::code(common::EXIT_OK))
}
