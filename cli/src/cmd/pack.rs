//! `snapctl pack`: a checkpoint directory becomes an image in a local OCI layout.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context};
use imgfmt::reference::{Reference, Selector};
use imgfmt::{BlobSource, Compression, HashAlgo, Kind, OciLayout};
use pusher::{PackOptions, ParentNote};

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
/// Packing into a tag that already holds an image of the same files makes a layer over
/// that image without being asked (stderr says so; --no-parent packs a full image). "The
/// same files": the same kind, chunk size and hash, and the same set of file names
/// (sizes and content may differ: that is what the layer records).
///
/// Examples:
///   snapctl pack ./fc-snap oci:./images:vm1
///   snapctl pack ./fc-snap oci:./images:vm1          (again, later: a layer over the first)
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
    /// With --base: a new chunk is also compressed with zstd against the base's chunk at
    /// the same position (read from the base and verified), and stored that way when
    /// smaller (codec `zstd-ref`, spec/format.md §7): a clone's chunk that differs from
    /// its base's by a few bytes, or by shifted bytes, costs about those bytes. A first
    /// pass is at level 3; a chunk that came to under a quarter of its size is compressed
    /// again at LEVEL. A reader then also reads that base chunk. After 32 tries of which
    /// fewer than a quarter paid (an image that is no close relative of its base), no more
    /// of the base's chunks are read. `off`: only identical chunks are shared.
    #[arg(long, value_name = "LEVEL|off", default_value_t = BaseDelta(Some(pusher::DEFAULT_BASE_DELTA_LEVEL)), value_parser = parse_base_delta)]
    pub base_delta: BaseDelta,
    /// Make an incremental layer over this image: only changed chunks are recorded.
    /// [default: pack: the image the destination tag holds, if it is of the same files;
    /// push: the closest image of the same files in the destination repository, see
    /// `snapctl push --help`]
    #[arg(long, value_name = "REF")]
    pub parent: Option<String>,
    /// Take no parent by itself (not the destination tag's image, nor, for a push, the
    /// closest one in the repository): pack (and push) a full image.
    #[arg(long, conflicts_with_all = ["parent", "diff"])]
    pub no_parent: bool,
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
    /// Compact a long history: when the image, a layer over its parent (or rebased),
    /// would read from more than N of the chain's packs beyond the fewest its bytes need,
    /// the chunks it still uses from the least-used packs are stored again in its own, so
    /// that it reads from few (spec/format.md §10, "Compaction"). `off`: never.
    #[arg(long, value_name = "N|off", default_value_t = CompactAfter(Some(pusher::DEFAULT_COMPACT_AFTER)), value_parser = parse_compact_after)]
    pub compact_after: CompactAfter,
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

/// `--compact-after`: a bound in packs, or never.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CompactAfter(pub Option<usize>);

impl std::fmt::Display for CompactAfter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(n) => write!(f, "{n}"),
            None => f.write_str("off"),
        }
    }
}

fn parse_compact_after(s: &str) -> Result<CompactAfter, String> {
    if s.eq_ignore_ascii_case("off") {
        return Ok(CompactAfter(None));
    }
    s.parse::<usize>().map(|n| CompactAfter(Some(n))).map_err(|_| format!("{s:?}: a number of packs, or off"))
}

/// `--base-delta`: a zstd level, or never.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BaseDelta(pub Option<i32>);

impl std::fmt::Display for BaseDelta {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(n) => write!(f, "{n}"),
            None => f.write_str("off"),
        }
    }
}

fn parse_base_delta(s: &str) -> Result<BaseDelta, String> {
    if s.eq_ignore_ascii_case("off") {
        return Ok(BaseDelta(None));
    }
    match s.parse::<i32>() {
        Ok(n) if (1..=22).contains(&n) => Ok(BaseDelta(Some(n))),
        _ => Err(format!("{s:?}: a zstd level 1..=22, or off")),
    }
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
    let scan = validate(&a.src, &a.flags)?;
    let dest: Reference = a.dest.parse()?;
    let Some(path) = dest.layout_path() else { bail!("{}: pack writes a local layout (oci:PATH:TAG); to send it to a registry use `snapctl push`", a.dest) };
    let Selector::Tag(tag) = dest.selector() else { bail!("{}: pack needs a tag, not a digest", a.dest) };
    let layout = OciLayout::open_or_create(path).with_context(|| format!("opening layout {}", path.display()))?;
    // The image already under the tag, as the parent of this one if it is of the same files.
    let held = match layout.resolve_tag(tag) {
        Ok(digest) if a.flags.parent.is_none() && !a.flags.no_parent => Some(digest),
        _ => None,
    };
    let report = with_pack_options(&a.flags, |opts| {
        let parent = held.and_then(|digest| tag_image(&layout, digest, &a.dest, &scan, &opts));
        let pb = progress_bar(scan.total_bytes(), "pack");
        let tick = |n: u64| {
            if let Some(pb) = &pb {
                pb.inc(n)
            }
        };
        let opts = PackOptions { parent: parent.or(opts.parent), progress: Some(&tick), ..opts };
        let report = pusher::pack_scanned(&scan, &layout, tag, &opts).with_context(|| format!("packing {}", a.src.display()));
        if let Some(pb) = pb {
            pb.finish_and_clear();
        }
        report
    })?;
    for s in &report.skipped {
        eprintln!("warning: skipped {s}: not a regular file");
    }
    for line in rebase_note(&report, a.flags.max_chain).into_iter().chain(compaction_note(&report)) {
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

/// The image `digest` the destination tag (`reference`) holds, as the parent of the new
/// image when it is of the same files as the directory `scan` walked; stderr says which,
/// or why not.
fn tag_image<'a>(
    layout: &'a OciLayout,
    digest: imgfmt::OciDigest,
    reference: &str,
    scan: &pusher::DirScan,
    opts: &PackOptions<'_>,
) -> Option<pusher::Related<'a>> {
    let image = imgfmt::Image::open(layout, &digest).map_err(anyhow::Error::new).and_then(|img| Ok(pusher::same_files(&img, scan, opts).map(|()| img)?));
    match image {
        Ok(image) => {
            let why = "the tag holds an image of the same files";
            eprintln!("{}", parent_line(&ParentNote::Taken { reference, digest: &digest, why }));
            Some(pusher::Related { source: layout, image, reference: reference.to_string() })
        }
        Err(e) => {
            eprintln!("{}", parent_line(&ParentNote::NotTaken { reference, why: &format!("{e:#}") }));
            None
        }
    }
}

/// For people: the parent a new image of a directory was made over by itself, or why
/// none was.
pub fn parent_line(note: &ParentNote<'_>) -> String {
    match note {
        ParentNote::Taken { reference, digest, why } => {
            format!("{} as the parent ({digest}): {why}, so only what changed is stored and sent (--no-parent: a full image)", common::printable(reference))
        }
        ParentNote::NotTaken { reference, why } => format!("not taking {} as the parent: {why}; packing a full image", common::printable(reference)),
        ParentNote::None { why } => format!("no parent: {why}; pushing a full image (--parent REF names one)"),
    }
}

/// For people: what a compaction did, when there was one.
pub fn compaction_note(report: &pusher::PackReport) -> Option<String> {
    report.compacted.then(|| {
        format!(
            "compacted: the history's packs were fragmented (--compact-after); {} unchanged chunks ({}) of {} little-used packs were stored again, so the image reads from {} packs beyond the fewest its bytes need",
            report.compacted_chunks,
            imgfmt::size::human(report.compacted_bytes),
            report.packs_retired,
            report.excess_packs
        )
    })
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

/// Check the flags and the source before anything is created; the source's one walk.
pub fn validate(src: &Path, f: &PackFlags) -> anyhow::Result<pusher::DirScan> {
    if !f.chunk_size.is_power_of_two() || !(64 << 10..=16 << 20).contains(&f.chunk_size) {
        bail!("--chunk-size {}: must be a power of two from 64KiB to 16MiB", f.chunk_size);
    }
    f.slice_shift()?;
    let scan = pusher::DirScan::take(src)?;
    scan.require_files()?;
    Ok(scan)
}

/// Run `body` with the [`PackOptions`] the flags say (base and parent opened).
pub fn with_pack_options<R>(f: &PackFlags, body: impl FnOnce(PackOptions<'_>) -> anyhow::Result<R>) -> anyhow::Result<R> {
    let mut annotations = BTreeMap::new();
    for kv in &f.annotations {
        let (k, v) = kv.split_once('=').with_context(|| format!("--annotation {kv:?}: expected KEY=VALUE"))?;
        annotations.insert(k.to_string(), v.to_string());
    }
    let base_src = f.base.as_deref().map(open_ref).transpose()?;
    let parent_src = f.parent.as_deref().map(open_ref).transpose()?;
    let opts = PackOptions {
        kind: f.kind,
        chunk_shift: f.chunk_size.trailing_zeros() as u8,
        compression: f.compression,
        hash: f.hash,
        pack_size: f.pack_size,
        slice_shift: f.slice_shift()?,
        base: base_src.as_ref().map(related).transpose()?,
        parent: parent_src.as_ref().map(related).transpose()?,
        diff: f.diff,
        max_chain: f.max_chain as usize,
        compact_after: f.compact_after.0,
        base_delta: f.base_delta.0,
        annotations,
        ..Default::default()
    };
    body(opts)
}

/// The image `o` names, opened, as an image a new one builds on.
fn related(o: &common::Opened) -> anyhow::Result<pusher::Related<'_>> {
    Ok(pusher::Related { source: o.source.as_ref(), image: open_image(o)?, reference: o.reference.clone() })
}
