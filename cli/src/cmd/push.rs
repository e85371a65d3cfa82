//! `snapctl push`: an image (from a local layout, or a checkpoint directory packed on the
//! fly) goes to a repository of any OCI registry.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::OnceLock;

use anyhow::{bail, Context as _};
use imgfmt::reference::{Reference, Selector};
use imgfmt::{BlobSource, OciDigest};
use pusher::{CopyOptions, ParentNote, PushReport, Reused};
use regclient::{UploadOptions, UploadProgress};

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
/// On a terminal, stderr shows the progress: for a directory, a bar for packing (the
/// directory's bytes) and one for uploading (the bytes to upload: growing as packs are
/// made, exact once packing ends), each with the time left at the rate of the last
/// seconds.
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
    #[command(flatten)]
    pub cache: super::cache::CacheDir,
    /// Print a JSON report on stdout instead of the manifest digest.
    #[arg(long)]
    pub json: bool,
}

impl TransferFlags {
    pub fn cache_dir(&self) -> PathBuf {
        self.cache.path()
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
    let (_, manifest) = pusher::copy::manifest_blobs(src, digest).map_err(|e| wrap(e, verb))?;
    let total: u64 = std::iter::once(&manifest.config).chain(&manifest.layers).map(|d| d.size).sum();
    let bar = CopyBar(common::network_progress_bar(total, verb));
    let mut opts = copy_options(flags)?;
    opts.observer = Some(&bar);
    let sent = pusher::copy::copy_after(src, digest, target, tag, &opts, &[]).and_then(|mut report| then(&opts, &mut report).map(|()| report));
    if let Some(pb) = &bar.0 {
        pb.finish_and_clear();
    }
    finish(sent.map_err(|e| wrap(e, verb))?, digest, flags, verb, signing)
}

/// A copy's bar: the work done, blobs found at the destination included, so that it ends
/// at the image's size.
struct CopyBar(Option<indicatif::ProgressBar>);

impl pusher::TransferObserver for CopyBar {
    fn found(&self, blob: &imgfmt::Descriptor) {
        if let Some(pb) = &self.0 {
            pb.inc(blob.size);
        }
    }
    fn progress(&self, _: &imgfmt::Descriptor, p: UploadProgress) {
        if let Some(pb) = &self.0 {
            match p {
                UploadProgress::Sent(n) | UploadProgress::Skipped(n) => pb.inc(n),
                UploadProgress::Again(n) => pb.set_position(pb.position().saturating_sub(n)),
            }
        }
    }
}

/// After a transfer: say what the registry declined, sign what arrived when `signing`
/// says so, then print the digest or the report.
fn finish(mut report: PushReport, digest: &OciDigest, flags: &TransferFlags, verb: &str, signing: Option<Signing<'_>>) -> anyhow::Result<PushReport> {
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

fn copy_options(flags: &TransferFlags) -> anyhow::Result<CopyOptions<'static>> {
    if flags.upload_piece == 0 {
        bail!("--upload-piece must be at least 1 byte");
    }
    Ok(CopyOptions {
        jobs: flags.jobs as usize,
        mount_from: flags.mount_from.clone(),
        upload: UploadOptions { piece: flags.upload_piece.min(regclient::MAX_PIECE), cache_dir: Some(flags.cache_dir()), source_hashed: false },
        observer: None,
    })
}

fn wrap(e: pusher::CopyError, verb: &str) -> anyhow::Error {
    if e.is_integrity() {
        anyhow::Error::new(IntegrityError(format!("{verb}: {e}")))
    } else {
        anyhow::Error::new(e).context(verb.to_string())
    }
}

/// `push DIR`'s progress on a terminal, and the notes it prints on stderr as it goes: a
/// bar for packing (the directory's bytes, from the walk; finished at its total when
/// packing ends) and one for uploading (the bytes to upload as far as known: growing as
/// packs are sealed, exact once packing is done), each with the time left at the rate of
/// the last seconds.
struct PushBars<'a> {
    dir: &'a Path,
    max_chain: u16,
    pack_total: AtomicU64,
    pack: OnceLock<Option<indicatif::ProgressBar>>,
    upload: OnceLock<Option<indicatif::ProgressBar>>,
}

impl PushBars<'_> {
    fn new(dir: &Path, max_chain: u16) -> PushBars<'_> {
        PushBars { dir, max_chain, pack_total: AtomicU64::new(0), pack: OnceLock::new(), upload: OnceLock::new() }
    }

    /// Take the bars off the terminal.
    fn clear(&self) {
        for pb in [self.pack.get(), self.upload.get()].into_iter().flatten().flatten() {
            pb.finish_and_clear();
        }
    }
}

impl pusher::PushObserver for PushBars<'_> {
    fn scanned(&self, scan: &pusher::DirScan) {
        self.pack_total.store(scan.total_bytes(), Relaxed);
    }
    fn parent(&self, note: &ParentNote<'_>) {
        common::say(&super::pack::parent_line(note));
    }
    fn packed(&self, n: u64) {
        if let Some(pb) = self.pack.get_or_init(|| common::progress_bar(self.pack_total.load(Relaxed), "pack")) {
            pb.inc(n);
        }
    }
    fn packing_done(&self, reused: Option<Reused>, report: Option<&pusher::PackReport>) {
        if let Some(Some(pb)) = self.pack.get() {
            pb.set_position(pb.length().unwrap_or(0));
            pb.finish();
        }
        let dir = self.dir.display();
        match reused {
            Some(Reused::Stamp) => common::say(&format!("{dir}: unchanged since it was last packed (same stamp): not packing again")),
            Some(Reused::Parent) => common::say(&format!("{dir}: unchanged: the parent already holds this content (its manifest is pushed as it is)")),
            Some(Reused::Previous) | None => {
                for s in report.iter().flat_map(|r| &r.skipped) {
                    common::say(&format!("warning: skipped {s}: not a regular file"));
                }
                if reused == Some(Reused::Previous) {
                    common::say(&format!("{dir}: unchanged since the last push"));
                }
            }
        }
        if let Some(r) = report {
            for line in super::pack::rebase_note(r, self.max_chain).into_iter().chain(super::pack::compaction_note(r)) {
                common::say(&line);
            }
        }
    }
    fn upload_total(&self, bytes: u64) {
        if let Some(pb) = self.upload.get_or_init(|| common::upload_bar("upload")) {
            pb.set_length(bytes);
        }
    }
    fn uploaded(&self, n: u64) {
        if let Some(Some(pb)) = self.upload.get() {
            pb.inc(n);
        }
    }
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
    } else if !Path::new(&a.src).exists() && a.src.parse::<Reference>().is_ok_and(|r| r.host().is_some()) {
        bail!("{}: push sends a local image or directory; to move an image from one registry to another use `snapctl copy {} {}`", a.src, a.src, a.dest);
    } else {
        push_dir(&a, &dest, tag, (host, repository))?;
    }
    // Everything under the cache directory is brought within the budget (the push layout
    // was released when the push ended: an eviction may take it).
    let cache_dir = a.transfer.cache_dir();
    if let Err(e) = puller::cache::keep_within_budget(&cache_dir, a.budget.cache_size) {
        eprintln!("warning: keeping the cache directory {} within {}: {e}", cache_dir.display(), imgfmt::size::human(a.budget.cache_size));
    }
    Ok(common::code(common::EXIT_OK))
}

/// `push DIR`: the directory walked once, checked, then packed and pushed in one library
/// call with bars on a terminal.
fn push_dir(a: &PushArgs, dest: &regclient::RegistrySource, tag: &str, (host, repository): (&str, &str)) -> anyhow::Result<()> {
    let dir = Path::new(&a.src);
    let scan = super::pack::validate(dir, &a.pack)?;
    let target = pusher::Target::Registry(dest);
    let signing = Signing::for_target(&target, Some(tag), None, &a.transfer)?;
    let copy = copy_options(&a.transfer)?;
    // A --parent in the repository pushed to has its packs there as well.
    let parent_here = a.pack.parent.as_deref().and_then(|p| p.parse::<Reference>().ok()).is_some_and(|r| r.registry() == Some((host, repository)));
    let pushed = super::pack::with_pack_options(&a.pack, |mut pack| {
        pack.parent_packs_elsewhere |= parent_here;
        let opts = pusher::DirOptions {
            pack,
            // Another version or other options pack differently: a stamp recorded
            // under another key is not trusted.
            options_key: format!("snapctl {} {:?}", env!("CARGO_PKG_VERSION"), a.pack),
            cache_dir: a.transfer.cache_dir(),
            closest: (a.pack.parent.is_none() && !a.pack.no_parent).then_some(pusher::closest::DEFAULT_CANDIDATES),
        };
        let bars = PushBars::new(dir, a.pack.max_chain);
        let pushed = pusher::push_dir(&scan, dest, tag, opts, &copy, &bars);
        bars.clear();
        pushed.map_err(|e| match e {
            pusher::PushError::Copy(e) => wrap(e, "push"),
            e => anyhow::Error::new(e),
        })
    })?;
    finish(pushed.push, &pushed.manifest, &a.transfer, "push", signing)?;
    Ok(())
}
