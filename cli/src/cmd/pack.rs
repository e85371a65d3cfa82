//! `snapctl pack`: a checkpoint directory becomes an image in a local OCI layout.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context};
use imgfmt::reference::{Reference, Selector};
use imgfmt::{Compression, HashAlgo, Kind, OciLayout};
use pusher::PackOptions;

use super::common::{self, open_image, open_ref, outln, progress_bar};

/// Pack a checkpoint directory into an image.
///
/// Files are cut into fixed chunks; all-zero chunks (and holes of sparse files) are never
/// stored; identical chunks are stored once; with --base, chunks the base already has are
/// referenced; with --parent, the image is a layer that records only what changed. A
/// layer whose chain of parents would pass --max-chain (default 64, the most readers
/// open) is rebased instead: a full index pointing into the chain's packs.
/// Prints the manifest digest.
///
/// Examples:
///   snapctl pack ./fc-snap oci:./images:vm1
///   snapctl pack ./fc-snap-2 oci:./images:vm2 --parent oci:./images:vm1
///   snapctl pack ./fc-diff oci:./images:vm3 --parent oci:./images:vm2 --diff
#[derive(Debug, clap::Args)]
#[command(verbatim_doc_comment)]
pub struct PackArgs {
    /// Checkpoint directory (Firecracker, gVisor, CRIU, or any directory).
    pub src: PathBuf,
    /// Destination: oci:PATH[:TAG] (created if missing; TAG defaults to "latest").
    pub dest: String,
    #[command(flatten)]
    pub flags: PackFlags,
    #[command(flatten)]
    pub registry: super::common::RegistryFlags,
    /// Print a JSON report on stdout instead of the digest.
    #[arg(long)]
    pub json: bool,
}

/// How a directory is packed: shared by `pack` and `push DIR` (which packs on the fly).
#[derive(Debug, Clone, clap::Args)]
pub struct PackFlags {
    /// Runtime that wrote the checkpoint [default: detected from file names].
    #[arg(long, value_parser = |s: &str| s.parse::<Kind>())]
    pub kind: Option<Kind>,
    /// Chunk size: a power of two from 64KiB to 16MiB (e.g. 1MiB, 262144).
    #[arg(long, default_value = "1MiB", value_parser = common::parse_size)]
    pub chunk_size: u64,
    /// Per-chunk compression: none, zstd[:LEVEL], flate[:LEVEL]. Chunks that do not shrink
    /// by at least ~6% are stored raw.
    #[arg(long = "compress", default_value = "none", value_parser = |s: &str| s.parse::<Compression>())]
    pub compression: Compression,
    /// Chunk digest: blake3 or sha256.
    #[arg(long, default_value = "blake3", value_parser = |s: &str| s.parse::<HashAlgo>())]
    pub hash: HashAlgo,
    /// Reference chunks that this base image (oci:PATH[:TAG]) already has instead of storing them.
    #[arg(long, value_name = "REF")]
    pub base: Option<String>,
    /// Make an incremental layer over this image: only changed chunks are recorded.
    #[arg(long, value_name = "REF")]
    pub parent: Option<String>,
    /// Memory files are Firecracker diff snapshots (holes = unchanged since --parent).
    #[arg(long, requires = "parent")]
    pub diff: bool,
    /// Most ancestors a layer may have (0..=64). A layer over a --parent whose chain is
    /// already this long is rebased: written as a full image that points into the packs
    /// the chain already stored (no chunk of theirs is stored or uploaded again: a new
    /// index, config and manifest, and packs only for new chunks), and the next layer
    /// starts a new chain from it. 0: never a layer.
    #[arg(long, value_name = "N", default_value_t = imgfmt::config::MAX_CHAIN_DEPTH as u16,
          value_parser = clap::value_parser!(u16).range(0..=imgfmt::config::MAX_CHAIN_DEPTH as i64))]
    pub max_chain: u16,
    /// Largest pack blob.
    #[arg(long, default_value = "256MiB", value_parser = common::parse_size)]
    pub pack_size: u64,
    /// Slice size of the outboard that lets a lazy restore fetch and verify part of a raw
    /// chunk: a power of two from 4KiB to half the chunk size, or `none` for no outboard
    /// (costs 32 bytes per slice of raw data, 0.78% at 4KiB). BLAKE3 images only.
    /// [default: 4KiB with --hash blake3]
    #[arg(long, value_name = "SIZE|none", value_parser = parse_slice_size)]
    pub slice_size: Option<SliceSize>,
    /// Source annotation recorded in the config (repeatable).
    #[arg(long = "annotation", value_name = "KEY=VALUE")]
    pub annotations: Vec<String>,
}

/// `--slice-size`: a size, or no outboard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SliceSize {
    None,
    Bytes(u64),
}

fn parse_slice_size(s: &str) -> Result<SliceSize, String> {
    if s.eq_ignore_ascii_case("none") {
        return Ok(SliceSize::None);
    }
    common::parse_size(s).map(SliceSize::Bytes)
}

impl PackFlags {
    /// The outboard slice shift `pusher` is asked for: the default for BLAKE3, none for
    /// SHA-256 (not a tree), an explicit size checked against the chunk size.
    fn slice_shift(&self) -> anyhow::Result<Option<u8>> {
        match (self.slice_size, self.hash) {
            (Some(SliceSize::None), _) => Ok(None),
            (None, HashAlgo::Blake3) => Ok(Some(imgfmt::outboard::DEFAULT_SLICE_SHIFT)),
            (None, HashAlgo::Sha256) => Ok(None),
            (Some(SliceSize::Bytes(_)), HashAlgo::Sha256) => {
                bail!("--slice-size needs --hash blake3: only BLAKE3 digests can be verified a slice at a time (or pass --slice-size none)")
            }
            (Some(SliceSize::Bytes(n)), HashAlgo::Blake3) => {
                if !n.is_power_of_two() || n < 1 << imgfmt::outboard::MIN_SLICE_SHIFT || n > self.chunk_size / 2 {
                    bail!("--slice-size {n}: must be a power of two from 4KiB to half the chunk size ({}), or none", self.chunk_size / 2);
                }
                Ok(Some(n.trailing_zeros() as u8))
            }
        }
    }
}

pub fn run(a: PackArgs) -> anyhow::Result<ExitCode> {
    validate(&a.src, &a.flags)?;
    let (path, tag) = match a.dest.parse::<Reference>()? {
        Reference::Layout { path, selector: Selector::Tag(t) } => (path, t),
        Reference::Layout { selector: Selector::Digest(_), .. } => bail!("{}: pack needs a tag, not a digest", a.dest),
        Reference::Registry { .. } => bail!("{}: pack writes a local layout (oci:PATH:TAG); to send it to a registry use `snapctl push`", a.dest),
    };
    let layout = OciLayout::open_or_create(&path).with_context(|| format!("opening layout {}", path.display()))?;
    let report = pack_into(&a.src, &layout, &tag, &a.flags)?;
    for s in &report.skipped {
        eprintln!("warning: skipped {s}: not a regular file");
    }
    if let Some(line) = rebase_note(&report, a.flags.max_chain) {
        eprintln!("{line}");
    }
    if a.json {
        common::print_json(&report)?;
    } else {
        outln!("{}", report.manifest)?;
        eprintln!(
            "packed {} files, {} in {:.2}s: {} chunks ({} zero, {} stored, {} deduplicated, {} inherited), {} in packs",
            report.files,
            imgfmt::size::human(report.logical_bytes),
            report.seconds,
            report.chunks,
            report.zero_chunks,
            report.stored_chunks,
            report.deduplicated_chunks,
            report.inherited_chunks,
            imgfmt::size::human(report.pack_bytes)
        );
        if report.outboard_entries > 0 {
            eprintln!(
                "outboard: slice CVs of {} raw chunks at {} slices ({})",
                report.outboard_entries,
                imgfmt::size::human(report.slice_size),
                imgfmt::size::human(report.outboard_bytes)
            );
        }
    }
    Ok(common::code(common::EXIT_OK))
}

/// For people: what a rebase did, when there was one.
pub fn rebase_note(report: &pusher::PackReport, max_chain: u16) -> Option<String> {
    report.rebased.then(|| {
        format!(
            "rebased: a layer over {} would have had more than {max_chain} ancestors (--max-chain); wrote a full index instead that points into {} pack(s) the chain already stored (none copied); the next layer starts a new chain here",
            report.rebased_from.as_deref().unwrap_or("the parent"),
            report.chain_packs_referenced
        )
    })
}

/// Check the flags and the source before anything is created.
pub fn validate(src: &Path, f: &PackFlags) -> anyhow::Result<()> {
    if !f.chunk_size.is_power_of_two() || !(64 << 10..=16 << 20).contains(&f.chunk_size) {
        bail!("--chunk-size {}: must be a power of two from 64KiB to 16MiB", f.chunk_size);
    }
    f.slice_shift()?;
    if !src.is_dir() {
        bail!("{}: not a directory", src.display());
    }
    // An image of no file restores nothing: a wrong path is likelier than a wish for one.
    let scan = pusher::scan::scan_dir(src).with_context(|| format!("reading {}", src.display()))?;
    if scan.files.is_empty() {
        bail!("{}: nothing to pack: no regular file in it", src.display());
    }
    Ok(())
}

/// Pack directory `src` into `layout` as `tag` with the given flags (progress bar on a
/// terminal).
pub fn pack_into(src: &Path, layout: &OciLayout, tag: &str, f: &PackFlags) -> anyhow::Result<pusher::PackReport> {
    validate(src, f)?;
    with_pack_options(src, f, |opts| pusher::pack(src, layout, tag, &opts).with_context(|| format!("packing {}", src.display())))
}

/// Run `body` with the [`PackOptions`] the flags say (base and parent opened, a progress
/// bar on a terminal, cleared when `body` returns).
pub fn with_pack_options<R>(src: &Path, f: &PackFlags, body: impl FnOnce(PackOptions<'_>) -> anyhow::Result<R>) -> anyhow::Result<R> {
    let mut annotations = BTreeMap::new();
    for kv in &f.annotations {
        let (k, v) = kv.split_once('=').with_context(|| format!("--annotation {kv:?}: expected KEY=VALUE"))?;
        annotations.insert(k.to_string(), v.to_string());
    }
    let base_src = f.base.as_deref().map(open_ref).transpose()?;
    let parent_src = f.parent.as_deref().map(open_ref).transpose()?;
    let base = match &base_src {
        Some(o) => Some(pusher::Related { source: o.source.as_ref(), image: open_image(o)?, reference: o.reference.clone() }),
        None => None,
    };
    let parent = match &parent_src {
        Some(o) => Some(pusher::Related { source: o.source.as_ref(), image: open_image(o)?, reference: o.reference.clone() }),
        None => None,
    };
    let total: u64 = pusher::scan::scan_dir(src).with_context(|| format!("reading {}", src.display()))?.files.iter().map(|f| f.size).sum();
    let pb = progress_bar(total, "pack");
    let tick = |n: u64| {
        if let Some(pb) = &pb {
            pb.inc(n)
        }
    };
    let opts = PackOptions {
        kind: f.kind,
        chunk_shift: f.chunk_size.trailing_zeros() as u8,
        compression: f.compression,
        hash: f.hash,
        pack_size: f.pack_size,
        slice_shift: f.slice_shift()?,
        base,
        parent,
        diff: f.diff,
        max_chain: f.max_chain as usize,
        annotations,
        progress: Some(&tick),
        ..Default::default()
    };
    let out = body(opts);
    if let Some(pb) = pb {
        pb.finish_and_clear();
    }
    out
}
