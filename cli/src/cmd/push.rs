//! `snapctl push`: an image (from a local layout, or a checkpoint directory packed on the
//! fly) goes to a repository of any OCI registry.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Mutex;
use std::time::Instant;

use anyhow::{bail, Context};
use imgfmt::reference::{Reference, Selector};
use imgfmt::{BlobSource, OciDigest, OciLayout};
use pusher::copy::{Moved, PackStep};
use pusher::{CopyOptions, PushReport};
use regclient::UploadOptions;

use super::common::{self, outln, progress_bar, IntegrityError};
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
    transfer_with_pack(src, digest, target, tag, flags, verb, None)
}

/// [`transfer`], with the report also saying how a directory source was packed, and which
/// of its packs were sent while packing.
fn transfer_with_pack(
    src: &dyn BlobSource,
    digest: &OciDigest,
    target: &pusher::Target,
    tag: Option<&str>,
    flags: &TransferFlags,
    verb: &str,
    packed: Option<(PackStep, &[(OciDigest, Moved)])>,
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
    let mut opts = copy_options(flags);
    opts.progress = Some(&tick);
    let ahead = packed.as_ref().map_or(&[][..], |p| p.1);
    let mut report = pusher::copy::copy_after(src, digest, target, tag, &opts, ahead).map_err(|e| wrap(e, verb))?;
    report.pack = packed.map(|p| p.0);
    // For `push DIR` the packs were being sent while packing: the push took both.
    if let Some(p) = &report.pack {
        report.seconds += p.seconds;
    }
    if let Some(pb) = pb {
        pb.finish_and_clear();
    }
    if flags.json {
        common::print_json(&report)?;
    } else {
        outln!("{}", report.manifest)?;
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

pub fn run(a: PushArgs) -> anyhow::Result<ExitCode> {
    let (host, repository, tag) = match a.dest.parse::<Reference>()? {
        Reference::Registry { host, repository, selector: Selector::Tag(t) } => (host, repository, t),
        Reference::Registry { .. } => bail!("{}: push needs a tag (HOST/REPO:TAG), not a digest", a.dest),
        Reference::Layout { .. } => bail!("{}: push sends to a registry (HOST[:PORT]/REPO[:TAG]); for a local layout use `snapctl copy`", a.dest),
    };
    let dest = common::registry_client(&host, &repository, a.transfer.plain_http)?;
    let mut pack = None;
    let mut ahead = Vec::new();
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
        let started = Instant::now();
        let (layout, digest, packed, sent) = pack_sending_ahead(Path::new(&a.src), &a, &dest)?;
        if let Some(line) = packed.as_ref().and_then(|r| super::pack::rebase_note(r, a.pack.max_chain)) {
            eprintln!("{line}");
        }
        pack = Some(PackStep {
            skipped: packed.is_none(),
            seconds: started.elapsed().as_secs_f64(),
            chain_depth: packed.as_ref().map_or(0, |r| r.chain_depth),
            rebased: packed.as_ref().is_some_and(|r| r.rebased),
            rebased_from: packed.and_then(|r| r.rebased_from),
        });
        ahead = sent;
        (layout, digest)
    };
    transfer_with_pack(&layout, &digest, &pusher::Target::Registry(&dest), Some(&tag), &a.transfer, "push", pack.map(|p| (p, &ahead[..])))?;
    Ok(common::code(common::EXIT_OK))
}

/// Pack a directory (as [`pack_directory`]) while each pack is sent to `dest` as soon as it
/// is sealed, on up to 4 threads: the upload of one pack overlaps the packing of the next
/// instead of starting when packing is over. Returns how each pack sent ahead went; one
/// that failed is left to the push proper, which sends it again (resuming) and reports.
/// The pack report is `None` when packing was skipped (see [`pack_directory`]).
fn pack_sending_ahead(
    dir: &Path,
    a: &PushArgs,
    dest: &regclient::RegistrySource,
) -> anyhow::Result<(OciLayout, OciDigest, Option<pusher::PackReport>, SentAhead)> {
    let cache = a.transfer.cache_dir();
    let root = layout_root(dir, &cache)?;
    let packs = OciLayout::open_or_create(&root).with_context(|| format!("opening {}", root.display()))?;
    let mut opts = copy_options(&a.transfer);
    // The pack writer hashed every pack as it wrote it; the registry checks that digest
    // when it commits the blob. Hashing the bytes again on the way out was a quarter of
    // the push's CPU (a 2 GiB image on 2 cores, BENCHMARKS.md).
    opts.upload.source_hashed = true;
    let target = pusher::Target::Registry(dest);
    let ahead = Mutex::new(Vec::new());
    let (tx, rx) = std::sync::mpsc::channel::<(OciDigest, u64)>();
    let rx = Mutex::new(rx);
    let packed = std::thread::scope(|s| {
        for _ in 0..(a.transfer.jobs as usize).clamp(1, 4) {
            s.spawn(|| loop {
                let next = rx.lock().expect("poisoned").recv();
                let Ok((d, size)) = next else { return };
                let desc = imgfmt::Descriptor::new(imgfmt::media::PACK, d.clone(), size);
                match pusher::copy::send_blob(&packs, &desc, &target, &opts) {
                    Ok(m) => ahead.lock().expect("poisoned").push((d, m)),
                    Err(e) => tracing::debug!("sending pack {d} ahead: {e}"),
                }
            });
        }
        let tx = tx;
        let send = |d: &OciDigest, size: u64| {
            let _ = tx.send((d.clone(), size));
        };
        pack_directory(dir, &a.pack, &cache, Some(&send))
        // `tx` goes here: the senders finish what is queued, then stop.
    });
    let (layout, digest, report) = packed?;
    Ok((layout, digest, report, ahead.into_inner().expect("poisoned")))
}

/// Packs sent while packing, and how each went.
type SentAhead = Vec<(OciDigest, Moved)>;

/// The layout under the cache directory that `push DIR` packs `dir` into.
fn layout_root(dir: &Path, cache: &Path) -> anyhow::Result<PathBuf> {
    let canon = dir.canonicalize().with_context(|| format!("resolving {}", dir.display()))?;
    let key = OciDigest::of(canon.as_os_str().as_encoded_bytes());
    Ok(cache.join("push-layouts").join(&key.hex()[..32]))
}

/// Pack a directory into a layout of its own under the cache directory (one per source
/// path); also how it was packed (`None`: packing was skipped). When the directory's stamp (every entry's
/// name, size, times and inode, see [`Stamp`]) equals the one recorded when it was last
/// packed with the same options, the recorded manifest is used without reading the
/// files. When the content is unchanged though the stamp is not (same index and packs:
/// only the creation time would differ), the earlier manifest is used again. Either way
/// the registry is only asked what it has and nothing is sent.
fn pack_directory(
    dir: &Path,
    flags: &PackFlags,
    cache: &Path,
    on_pack: Option<pusher::OnPack<'_>>,
) -> anyhow::Result<(OciLayout, OciDigest, Option<pusher::PackReport>)> {
    super::pack::validate(dir, flags)?;
    let canon = dir.canonicalize().with_context(|| format!("resolving {}", dir.display()))?;
    let key = OciDigest::of(canon.as_os_str().as_encoded_bytes());
    let root = layout_root(dir, cache)?;
    let layout = OciLayout::open_or_create(&root).with_context(|| format!("opening {}", root.display()))?;
    let stamp_path = cache.join("push-layouts").join(format!("{}.stamp.json", &key.hex()[..32]));
    // A base or parent is named by a reference whose content can change under the same
    // name, so the stamp of this directory alone does not say the image would be the same.
    let options = (flags.base.is_none() && flags.parent.is_none()).then(|| format!("snapctl {} {:?}", env!("CARGO_PKG_VERSION"), flags));
    let before = match &options {
        Some(o) => Some(Stamp::take(&canon, o).with_context(|| format!("reading {}", dir.display()))?),
        None => None,
    };
    if let Some(stamp) = &before {
        if let Some(digest) = Stamp::recorded(&stamp_path, stamp).filter(|d| layout_has_image(&layout, d)) {
            eprintln!("{}: unchanged since it was last packed (same stamp): not packing again", dir.display());
            return Ok((layout, digest, None));
        }
    }
    let (digest, report) = pack_and_reuse(dir, &layout, flags, on_pack)?;
    if let (Some(before), Some(options)) = (before, &options) {
        // Recorded only when nothing changed while packing and no file was written so
        // recently that a later write could leave its times as they are (see Stamp::racy).
        let after = Stamp::take(&canon, options).with_context(|| format!("reading {}", dir.display()))?;
        if after.entries == before.entries && !before.racy() {
            Stamp { manifest: digest.to_string(), ..before }.save(&stamp_path).with_context(|| format!("writing {}", stamp_path.display()))?;
        } else {
            let _ = std::fs::remove_file(&stamp_path);
        }
    }
    Ok((layout, digest, Some(report)))
}

/// Whether `layout` holds manifest `digest` (checked) and every blob it lists, at their
/// sizes: a stamp is only trusted while the image it points to is still in the cache.
fn layout_has_image(layout: &OciLayout, digest: &OciDigest) -> bool {
    let Ok(bytes) = imgfmt::source::read_verified_blob(layout, digest, imgfmt::manifest::MAX_MANIFEST_BYTES) else { return false };
    let Ok(m) = imgfmt::Manifest::decode(&bytes) else { return false };
    std::iter::once(&m.config).chain(&m.layers).all(|d| layout.blob_size(&d.digest).is_ok_and(|n| n == d.size))
}

/// Pack `dir` into `layout`; when only the creation time differs from the image pushed
/// last from this directory, that image's manifest; and the pack report.
fn pack_and_reuse(dir: &Path, layout: &OciLayout, flags: &PackFlags, on_pack: Option<pusher::OnPack<'_>>) -> anyhow::Result<(OciDigest, pusher::PackReport)> {
    let previous = layout.resolve_tag("previous").ok();
    let report = super::pack::pack_into_with(dir, layout, "latest", flags, on_pack)?;
    for s in &report.skipped {
        eprintln!("warning: skipped {s}: not a regular file");
    }
    let new: OciDigest = report.manifest.parse()?;
    if let Some(old) = previous.filter(|o| o != &new) {
        let same = |d: &OciDigest| {
            imgfmt::source::read_verified_blob(layout, d, imgfmt::manifest::MAX_MANIFEST_BYTES).ok().and_then(|b| imgfmt::Manifest::decode(&b).ok())
        };
        if let (Some(a), Some(b)) = (same(&old), same(&new)) {
            if a.layers == b.layers && a.config.media_type == b.config.media_type {
                eprintln!("{}: unchanged since the last push", dir.display());
                return Ok((old, report));
            }
        }
    }
    let desc = imgfmt::Descriptor::new(imgfmt::media::OCI_MANIFEST, new.clone(), layout.blob_size(&new)?);
    layout.set_tag("previous", desc)?;
    Ok((new, report))
}

/// What a directory looked like when it was packed: every entry (recursively, the
/// directory itself included) with the metadata any change moves. A write to a file
/// always sets its ctime (which no user call can set back), a replaced file has another
/// inode, a renamed or removed one changes the names, so an equal stamp means the files
/// hold what was packed (spec/transfer.md §2).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Stamp {
    /// snapctl version and pack options: another version or option packs differently.
    options: String,
    entries: Vec<StampEntry>,
    /// When the stamp was taken (ns since the epoch).
    taken_ns: i64,
    /// Manifest the directory was packed to (empty until packed).
    manifest: String,
}

#[derive(Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct StampEntry {
    /// Relative path, `/`-separated ("" for the directory itself).
    name: String,
    /// st_mode: file type and permissions.
    mode: u32,
    size: u64,
    mtime_ns: i64,
    ctime_ns: i64,
    inode: u64,
    dev: u64,
}

/// A stamp file larger than this is not ours (a directory of a million entries is ~150 MB
/// of JSON; checkpoint directories hold a handful).
const MAX_STAMP_BYTES: u64 = 64 << 20;

impl Stamp {
    fn take(dir: &Path, options: &str) -> std::io::Result<Stamp> {
        use std::os::unix::fs::MetadataExt;
        let taken_ns = ns_since_epoch(std::time::SystemTime::now());
        let entry = |name: String, md: &std::fs::Metadata| StampEntry {
            name,
            mode: md.mode(),
            size: md.size(),
            mtime_ns: md.mtime().saturating_mul(1_000_000_000).saturating_add(md.mtime_nsec()),
            ctime_ns: md.ctime().saturating_mul(1_000_000_000).saturating_add(md.ctime_nsec()),
            inode: md.ino(),
            dev: md.dev(),
        };
        let mut entries = vec![entry(String::new(), &std::fs::symlink_metadata(dir)?)];
        let mut stack = vec![(dir.to_path_buf(), String::new())];
        while let Some((p, prefix)) = stack.pop() {
            for e in std::fs::read_dir(&p)? {
                let e = e?;
                let name = e.file_name().to_string_lossy().into_owned();
                let rel = if prefix.is_empty() { name } else { format!("{prefix}/{name}") };
                // Not followed: a symlink is recorded as itself (pack skips it).
                let md = std::fs::symlink_metadata(e.path())?;
                if md.is_dir() {
                    stack.push((e.path(), rel.clone()));
                }
                entries.push(entry(rel, &md));
            }
        }
        entries.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(Stamp { options: options.to_string(), entries, taken_ns, manifest: String::new() })
    }

    /// A file changed within a clock tick of the stamp: a second write in that same tick
    /// would leave mtime and ctime (and maybe size) as they are, so such a stamp is not
    /// recorded. The kernel stamps files from a coarse clock (ticks of up to 10 ms); on a
    /// file system with whole-second times (every nanosecond field 0) the margin is 2 s.
    fn racy(&self) -> bool {
        let whole_seconds = self.entries.iter().all(|e| e.ctime_ns % 1_000_000_000 == 0 && e.mtime_ns % 1_000_000_000 == 0);
        let margin: i64 = if whole_seconds { 2_000_000_000 } else { 20_000_000 };
        self.entries.iter().any(|e| e.ctime_ns.max(e.mtime_ns) >= self.taken_ns.saturating_sub(margin))
    }

    /// The manifest recorded at `path` when its stamp's options and entries equal `now`'s.
    /// Any problem reading it means "not recorded": the directory is packed again.
    fn recorded(path: &Path, now: &Stamp) -> Option<OciDigest> {
        use std::io::Read;
        let mut bytes = Vec::new();
        std::fs::File::open(path).ok()?.take(MAX_STAMP_BYTES).read_to_end(&mut bytes).ok()?;
        let old: Stamp = serde_json::from_slice(&bytes).ok()?;
        (old.options == now.options && old.entries == now.entries).then(|| old.manifest.parse().ok()).flatten()
    }

    /// Written to a temporary name and renamed, so a reader sees a whole stamp or none.
    fn save(&self, path: &Path) -> std::io::Result<()> {
        let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
        std::fs::write(&tmp, serde_json::to_vec(self)?)?;
        std::fs::rename(&tmp, path).inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })
    }
}

fn ns_since_epoch(t: std::time::SystemTime) -> i64 {
    t.duration_since(std::time::UNIX_EPOCH).map(|d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX)).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scratch directory removed on drop (the CLI crate has no tempfile dependency).
    struct Scratch(PathBuf);
    impl Scratch {
        fn new(name: &str) -> Scratch {
            let p = std::env::temp_dir().join(format!("snapctl-stamp-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(p.join("sub")).unwrap();
            std::fs::write(p.join("vm.mem"), vec![1u8; 8192]).unwrap();
            std::fs::write(p.join("sub/vm.state"), b"state").unwrap();
            Scratch(p)
        }
    }
    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn stamp_lists_every_entry_and_sees_renames_removals_and_options() {
        let d = Scratch::new("entries");
        let s = Stamp::take(&d.0, "o").unwrap();
        let names: Vec<&str> = s.entries.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["", "sub", "sub/vm.state", "vm.mem"]);
        assert_eq!(s.entries[3].size, 8192);
        assert_eq!(Stamp::take(&d.0, "o").unwrap().entries, s.entries, "nothing changed");

        // Saved and read back: the manifest for the same stamp, nothing for other options
        // or another directory state.
        let file = d.0.with_extension("stamp.json");
        let digest = OciDigest::of(b"manifest");
        Stamp { manifest: digest.to_string(), ..Stamp::take(&d.0, "o").unwrap() }.save(&file).unwrap();
        assert_eq!(Stamp::recorded(&file, &Stamp::take(&d.0, "o").unwrap()), Some(digest));
        assert_eq!(Stamp::recorded(&file, &Stamp::take(&d.0, "other options").unwrap()), None);
        std::fs::rename(d.0.join("sub/vm.state"), d.0.join("sub/vm.state2")).unwrap();
        assert_eq!(Stamp::recorded(&file, &Stamp::take(&d.0, "o").unwrap()), None, "renamed");
        std::fs::remove_file(d.0.join("sub/vm.state2")).unwrap();
        assert_ne!(Stamp::take(&d.0, "o").unwrap().entries, s.entries, "removed");
        // A damaged stamp file is "not recorded", not an error.
        std::fs::write(&file, b"{not json").unwrap();
        assert_eq!(Stamp::recorded(&file, &s), None);
        std::fs::remove_file(&file).unwrap();
    }

    /// Files written just now could be written again within the same clock tick without
    /// their times moving: such a stamp must not be recorded.
    #[test]
    fn a_stamp_of_files_written_just_now_is_racy() {
        let d = Scratch::new("racy");
        assert!(Stamp::take(&d.0, "o").unwrap().racy());
        let mut old = Stamp::take(&d.0, "o").unwrap();
        old.taken_ns += 60_000_000_000;
        assert!(!old.racy(), "a minute later the same times are safe");
    }
}
