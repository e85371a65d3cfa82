//! Whole-image audits: every chunk of every image in the chain checked against its
//! digest, every Merkle root recomputed, and (`audit_against`) a local directory proven
//! byte-for-byte equal to the snapshot.

use std::borrow::Cow;
use std::collections::HashSet;
use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use imgfmt::compress::Codec;
use imgfmt::outboard::Outboard;
use imgfmt::{media, resolve_chain, BlobSource, ChainLink, ChunkDigest, FormatError, HashAlgo, Image, OciDigest, PackRef, RecordKind, ResolvedFile, StoredAt};
use serde::Serialize;

use crate::chunk::verify_stored_ref;
use crate::hash::{chunk_digest, is_zero, merge_slice_cvs, zero_digest};
use crate::merkle::resolved_root;

/// What kind of integrity failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum FailureKind {
    /// A stored chunk's bytes do not hash to its recorded digest.
    ChunkDigest,
    /// A stored chunk does not decompress to its size.
    ChunkCorrupt,
    /// A zero chunk is recorded with a digest other than that of zeros.
    ZeroRecord,
    /// A pack blob is missing, has the wrong size, or could not be read.
    PackUnreadable,
    /// A pack blob's sha256 is not its name (`--blob-digests`).
    PackDigest,
    /// A file's Merkle root differs from the config's.
    FileRoot,
    /// The image root differs from the config's or the manifest annotation's.
    ImageRoot,
    /// A parent or base reference names a different root than the referenced image has.
    ChainRoot,
    /// A file of the directory differs from the snapshot (`--against`).
    FileContent,
    /// An outboard is unreadable or malformed, an entry's slice CVs do not merge to its
    /// chunk digest, or a raw chunk longer than a slice has no entry.
    Outboard,
    /// A file is missing, or its size or mode differs (`--against`).
    FileMetadata,
    /// A file in the directory is not part of the snapshot (`--against`).
    UnexpectedFile,
}

/// One integrity failure, naming where it is.
#[derive(Debug, Clone, Serialize)]
pub struct Failure {
    pub kind: FailureKind,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub file: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chunk: Option<u64>,
    /// Byte offset of the chunk in its file.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub offset: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub blob: Option<String>,
    /// Byte offset in the blob.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub blob_offset: Option<u64>,
    pub message: String,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(file) = &self.file {
            write!(f, "{file}")?;
            if let (Some(c), Some(o)) = (self.chunk, self.offset) {
                write!(f, ": chunk {c} at offset {o}")?;
            }
            write!(f, ": ")?;
        }
        write!(f, "{}", self.message)?;
        if let Some(b) = &self.blob {
            write!(f, " [blob {b}")?;
            if let Some(o) = self.blob_offset {
                write!(f, " at {o}")?;
            }
            write!(f, "]")?;
        }
        Ok(())
    }
}

#[derive(Debug, Clone)]
pub struct AuditOptions {
    /// Worker threads for hashing (default: available cores).
    pub threads: usize,
    /// Also re-hash every pack blob with sha256 (its OCI name). Chunk digests already
    /// cover every byte a restore uses; this also catches changes to bytes no chunk uses.
    pub blob_digests: bool,
    /// Range reads in flight at once, at least (default [`DEFAULT_IN_FLIGHT`]). Each
    /// worker waits a round trip per range, so a registry 20 ms away needs more of them
    /// than there are cores to keep its link busy; hashing still takes only the CPU
    /// there is.
    pub in_flight: usize,
    /// Neighbouring stored chunks of a pack are read in one range of at most this many
    /// bytes (default [`DEFAULT_AUDIT_RANGE`]): one round trip per range, not per chunk.
    pub max_range: u64,
}

/// Range reads an audit keeps in flight by default: 16 ranges of 8 MiB fill 1 Gbit/s at
/// 50 ms RTT (spec/format.md §11, step 10).
pub const DEFAULT_IN_FLIGHT: usize = 16;
/// Largest range an audit reads at once by default.
pub const DEFAULT_AUDIT_RANGE: u64 = 8 << 20;

impl Default for AuditOptions {
    fn default() -> Self {
        AuditOptions {
            threads: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2),
            blob_digests: false,
            in_flight: DEFAULT_IN_FLIGHT,
            max_range: DEFAULT_AUDIT_RANGE,
        }
    }
}

/// Failures an audit lists; more are counted in [`AuditReport::failures_unlisted`]. A
/// hostile image can make every one of its 4 M chunks fail, and a listed failure costs a
/// few hundred bytes: the first thousand say what is wrong as well.
pub const MAX_LISTED_FAILURES: usize = 1000;

#[derive(Debug, Default, Clone, Serialize)]
pub struct AuditReport {
    /// Images audited (the image, and its base when the source holds it).
    pub images: Vec<String>,
    pub stored_chunks_checked: u64,
    pub stored_bytes_checked: u64,
    pub zero_chunks: u64,
    pub packs: u64,
    /// The first [`MAX_LISTED_FAILURES`] failures.
    /// Outboard entries whose slice CVs were merged and compared with their chunk digest.
    pub outboard_entries_checked: u64,
    pub failures: Vec<Failure>,
    /// Failures beyond those listed.
    pub failures_unlisted: u64,
}

impl AuditReport {
    pub fn ok(&self) -> bool {
        self.failures.is_empty() && self.failures_unlisted == 0
    }

    /// Every failure, listed or not.
    pub fn failure_count(&self) -> u64 {
        self.failures.len() as u64 + self.failures_unlisted
    }

    /// Record a failure: listed while there is room, counted after.
    pub fn push_failure(&mut self, f: Failure) {
        push_bounded(&mut self.failures, &mut self.failures_unlisted, f);
    }

    /// Add another report's failures (`--against` after the audit).
    pub fn merge_failures(&mut self, other: &AuditReport) {
        for f in &other.failures {
            self.push_failure(f.clone());
        }
        self.failures_unlisted += other.failures_unlisted;
    }
}

fn push_bounded(list: &mut Vec<Failure>, unlisted: &mut u64, f: Failure) {
    if list.len() < MAX_LISTED_FAILURES {
        list.push(f);
    } else {
        *unlisted += 1;
    }
}

/// Failures found by worker threads: bounded like the report's list, sorted when taken.
#[derive(Default)]
struct Found {
    list: Vec<Failure>,
    unlisted: u64,
}

impl Found {
    fn push(m: &Mutex<Found>, f: Failure) {
        let mut g = m.lock().expect("poisoned");
        let Found { list, unlisted } = &mut *g;
        push_bounded(list, unlisted, f);
    }
}

fn fail(kind: FailureKind, message: impl Into<String>) -> Failure {
    Failure { kind, file: None, chunk: None, offset: None, blob: None, blob_offset: None, message: message.into() }
}

/// One stored range to check, with the first (file, chunk) that uses it, for naming:
/// file `file` of chain link `link` (its name is in that link's config). 72 bytes, one
/// per distinct stored range: no name copied per chunk.
struct Work {
    pack: u32,
    at: u64,
    stored_len: u32,
    /// The codec's code and, for `zstd-ref`, its reference pack (kept apart: a `Codec` is
    /// 8 bytes): an index into the image's pack table, or past its end into the
    /// [`References`] an ancestor's replaced chunk reads that the image does not list.
    codec: u8,
    ref_pack: u32,
    len: u32,
    digest: ChunkDigest,
    link: u8,
    file: u32,
    chunk: u64,
}

// spec/format.md §12 states this size.
const _: () = assert!(std::mem::size_of::<Work>() <= 72);

impl Work {
    /// What makes two stored ranges the same check.
    fn key(&self) -> (u32, u64, ChunkDigest, u32) {
        (self.pack, self.at, self.digest, self.len)
    }
}

/// Audit an opened image (and its base, when `src` has it). Metadata blobs were already
/// checked by [`Image::open`]; this checks chunks, pack sizes and every root.
pub fn audit(src: &dyn BlobSource, image: &Image, opts: &AuditOptions) -> Result<AuditReport, FormatError> {
    let mut report = AuditReport::default();
    audit_one(src, image, opts, &mut report)?;
    // The base is a separate image; check it too when it is here, so "verify" covers every
    // byte a restore could read.
    // Bases are followed as deep as parents are (`MAX_CHAIN_DEPTH`): a chain of bases
    // built to be endless must not make `verify` open images without end.
    let mut next = image.config().base.clone();
    let mut seen: HashSet<OciDigest> = [image.manifest_digest.clone()].into();
    while let Some(b) = next.take() {
        if !seen.insert(b.manifest.clone()) || src.blob_size(&b.manifest).is_err() {
            break;
        }
        if seen.len() > imgfmt::config::MAX_CHAIN_DEPTH + 1 {
            return Err(FormatError::TooLarge { what: "base chain depth", got: seen.len() as u64 - 1, limit: imgfmt::config::MAX_CHAIN_DEPTH as u64 });
        }
        let base = Image::open(src, &b.manifest)?;
        if base.config().root != b.root {
            report.push_failure(fail(FailureKind::ChainRoot, format!("base {} has root {}, the image names {}", b.manifest, base.config().root, b.root)));
        }
        audit_one(src, &base, opts, &mut report)?;
        next = base.config().base.clone();
    }
    Ok(report)
}

/// One image of [`audit`] (the image, or a base): its manifest annotation, then each
/// phase below, into `report`.
fn audit_one(src: &dyn BlobSource, image: &Image, opts: &AuditOptions, report: &mut AuditReport) -> Result<(), FormatError> {
    report.images.push(image.manifest_digest.to_string());
    let ann = image.manifest.annotations.get(media::ANN_ROOT);
    if ann.is_some_and(|a| a != &image.config().root) {
        report.push_failure(fail(
            FailureKind::ImageRoot,
            format!("manifest annotation {} = {}, config root {}", media::ANN_ROOT, ann.map(String::as_str).unwrap_or(""), image.config().root),
        ));
    }
    let (mut work, refs) = audit_links(src, image, report)?;
    let bad_packs = audit_pack_sizes(src, image, report);
    let absent = refs.absent(src, image.packs.len());
    work.retain(|w| !bad_packs.contains(&w.pack) && !(Codec::from_code(w.codec, w.ref_pack).and_then(Codec::ref_pack).is_some_and(|rp| absent.contains(&rp))));
    let (found, bytes) = audit_chunks(src, image, &work, &refs, &bad_packs, opts);
    for f in found.list {
        report.push_failure(f);
    }
    report.failures_unlisted += found.unlisted;
    report.stored_chunks_checked += work.len() as u64;
    report.stored_bytes_checked += bytes;
    Ok(())
}

/// Reference packs of an ancestor's replaced `zstd-ref` chunks that the image's pack table
/// does not hold (the image does not read them, so its manifest need not list them),
/// numbered after the image's packs.
#[derive(Default)]
struct References(Vec<PackRef>);

impl References {
    /// The index [`Work::ref_pack`] holds for reference pack `p` of an ancestor's own table:
    /// its index in the image's table, else one past it in this list.
    fn index(&mut self, image: &Image, p: &PackRef) -> u32 {
        image.pack_index(&p.digest).unwrap_or_else(|| {
            let i = self.0.iter().position(|q| q.digest == p.digest).unwrap_or_else(|| {
                self.0.push(p.clone());
                self.0.len() - 1
            });
            (image.packs.len() + i) as u32
        })
    }

    /// The pack a [`Work::ref_pack`] names.
    fn get<'a>(&'a self, image: &'a Image, rp: u32) -> Option<&'a PackRef> {
        let rp = rp as usize;
        image.packs.get(rp).or_else(|| self.0.get(rp.checked_sub(image.packs.len())?))
    }

    /// Indexes (as [`Self::index`] gives them) of the listed packs `src` does not have: the
    /// chunks that read them are not checked (nothing of the image's is there).
    fn absent(&self, src: &dyn BlobSource, own: usize) -> HashSet<u32> {
        let absent = |p: &PackRef| matches!(src.blob_size(&p.digest), Err(e) if e.kind() == imgfmt::ErrorKind::NotFound);
        self.0.iter().enumerate().filter(|(_, p)| absent(p)).map(|(i, _)| (own + i) as u32).collect()
    }
}

/// Roots of every link of the chain, the references between links and each link's
/// outboard, checked into `report`; returns each distinct stored range to check once, and
/// the reference packs that are not the image's.
fn audit_links(src: &dyn BlobSource, image: &Image, report: &mut AuditReport) -> Result<(Vec<Work>, References), FormatError> {
    let algo = image.config().hash;
    let shift = image.chunk_shift();
    // Each distinct stored range once, kept sorted and deduplicated after each link: an
    // ancestor's range already listed is skipped (a binary search), so the list never
    // holds a link's duplicates at once. The first use of a range, in chain then file
    // order, names it.
    let stored = image.files.iter().flat_map(|f| &f.chunks).filter(|c| matches!(c.at, StoredAt::Pack { .. })).count();
    let mut work: Vec<Work> = Vec::with_capacity(stored);
    let mut refs = References::default();
    // Read before the loop over links, several at a time (a round trip each).
    let mut outboards = image.read_outboards(src).into_iter().map(|r| r.map_err(|e| e.to_string()).transpose());
    // The base's outboard (owner `base`), which holds the slice CVs of the base's chunks
    // this image shares: read, decoded and every entry's CVs merged like a link's.
    let base_ob = match image.read_base_outboard(src) {
        Ok(o) => o,
        Err(e) => {
            let blob = image.base_outboard_blob.as_ref().map(|d| d.digest.to_string());
            report.push_failure(Failure { blob, ..fail(FailureKind::Outboard, format!("base outboard: {e}")) });
            None
        }
    };
    if let (Some(ob), Some(d)) = (&base_ob, &image.base_outboard_blob) {
        check_outboard_entries(ob, &d.digest.to_string(), "base outboard", report);
    }
    for k in 0..image.chain.len() {
        let listed = work.len();
        let link = &image.chain[k];
        // The image's own resolution is borrowed; an ancestor's is made for this turn only.
        let (files, packs): (Cow<'_, [ResolvedFile]>, Cow<'_, [PackRef]>) = if k == 0 {
            (Cow::Borrowed(&image.files), Cow::Borrowed(&image.packs))
        } else {
            resolve_chain(&image.chain[k..]).map(|(f, p)| (Cow::Owned(f), Cow::Owned(p)))?
        };
        // Ancestors' packs in the image's table (or not part of the image: u32::MAX).
        let global: Vec<u32> = packs.iter().map(|p| image.pack_index(&p.digest).unwrap_or(u32::MAX)).collect();
        // The link's packs as `zstd-ref` references, looked up once each when first read.
        let mut as_ref: Vec<Option<u32>> = vec![None; packs.len()];
        let who = if k == 0 { "image".to_string() } else { format!("ancestor {k} (config {})", link.config_digest) };
        audit_link_roots(image, k, &files, &who, report);
        audit_outboard(link, outboards.next().flatten(), base_ob.as_ref(), &who, shift, report);
        for (fi, f) in files.iter().enumerate() {
            for (ci, c) in f.chunks.iter().enumerate() {
                match c.at {
                    StoredAt::Zero => {
                        report.zero_chunks += u64::from(k == 0);
                        if c.digest != zero_digest(algo, c.len) {
                            report.push_failure(Failure {
                                file: Some(f.name.clone()),
                                chunk: Some(ci as u64),
                                offset: Some((ci as u64) << shift),
                                ..fail(FailureKind::ZeroRecord, format!("zero chunk recorded with digest {}", c.digest))
                            });
                        }
                    }
                    StoredAt::Pack { pack, offset, stored_len, codec } => {
                        let gp = global[pack as usize];
                        if gp == u32::MAX {
                            // A chunk an ancestor had but this image replaced: its pack is
                            // not part of this image (the manifest need not list it), so
                            // there are no bytes to check; its digest still counted in the
                            // ancestor's root above.
                            continue;
                        }
                        if work[..listed].binary_search_by(|w| w.key().cmp(&(gp, offset, c.digest, c.len))).is_ok() {
                            continue;
                        }
                        work.push(Work {
                            pack: gp,
                            at: offset,
                            stored_len,
                            codec: codec.code(),
                            // Resolved in the link's own table: the reference of a chunk the
                            // image replaced need not be in the image's.
                            ref_pack: codec.ref_pack().map_or(0, |rp| *as_ref[rp as usize].get_or_insert_with(|| refs.index(image, &packs[rp as usize]))),
                            len: c.len,
                            digest: c.digest,
                            link: k as u8,
                            file: fi as u32,
                            chunk: ci as u64,
                        });
                    }
                }
            }
        }
        work.sort_unstable_by_key(|w| (w.key(), w.link, w.file, w.chunk));
        work.dedup_by_key(|w| w.key());
    }
    Ok((work, refs))
}

/// Link `k`'s file roots and content root recomputed from `files` (its resolution) and
/// compared with its config, and the root its child names for it.
fn audit_link_roots(image: &Image, k: usize, files: &[ResolvedFile], who: &str, report: &mut AuditReport) {
    let algo = image.config().hash;
    let link = &image.chain[k];
    let (roots, root) = resolved_root(algo, files);
    for ((f, r), cf) in files.iter().zip(&roots).zip(&link.config.files) {
        let want = r.display_with(algo);
        if cf.root != want {
            report.push_failure(Failure {
                file: Some(f.name.clone()),
                ..fail(FailureKind::FileRoot, format!("{who}: file root is {want}, config says {}", cf.root))
            });
        }
    }
    let want = root.display_with(algo);
    if link.config.root != want {
        report.push_failure(fail(FailureKind::ImageRoot, format!("{who}: content root is {want}, config says {}", link.config.root)));
    }
    if k > 0 {
        let named = &image.chain[k - 1].config.parent.as_ref().expect("link has a parent").root;
        if named != &link.config.root {
            report.push_failure(fail(FailureKind::ChainRoot, format!("{who}: root {} but its child names {named}", link.config.root)));
        }
    }
}

/// Packs: present and of the recorded size. Returns the table indexes of those that are
/// not (their chunks are not read). A size is a round trip on a registry, and an image
/// late in a chain points into a pack per layer that changed a chunk it still uses (41
/// after 70 one-chunk layers), so they are asked for several at a time, not one after
/// another.
fn audit_pack_sizes(src: &dyn BlobSource, image: &Image, report: &mut AuditReport) -> HashSet<u32> {
    let sizes: Vec<Mutex<Option<Result<u64, FormatError>>>> = image.packs.iter().map(|_| Mutex::new(None)).collect();
    for_each_index(image.packs.len(), STAT_THREADS.min(image.packs.len()), |i, _| {
        *sizes[i].lock().expect("poisoned") = Some(src.blob_size(&image.packs[i].digest));
    });
    let mut bad_packs = HashSet::new();
    for ((i, p), size) in image.packs.iter().enumerate().zip(sizes) {
        report.packs += 1;
        match size.into_inner().expect("poisoned").expect("every pack asked") {
            Ok(n) if n == p.size => {}
            Ok(n) => {
                bad_packs.insert(i as u32);
                report.push_failure(Failure {
                    blob: Some(p.digest.to_string()),
                    ..fail(FailureKind::PackUnreadable, format!("pack is {n} bytes, index says {}", p.size))
                });
            }
            Err(e) => {
                bad_packs.insert(i as u32);
                report.push_failure(Failure { blob: Some(p.digest.to_string()), ..fail(FailureKind::PackUnreadable, e.to_string()) });
            }
        }
    }
    bad_packs
}

/// Re-hash every pack of `image` not in `bad_packs` whole, against its digest; a pack
/// that hashes otherwise or cannot be read joins `failures`.
fn rehash_packs(src: &dyn BlobSource, image: &Image, bad_packs: &HashSet<u32>, failures: &Mutex<Found>) {
    for (i, p) in image.packs.iter().enumerate() {
        if bad_packs.contains(&(i as u32)) {
            continue;
        }
        match sha256_of_blob(src, &p.digest, p.size) {
            Ok(d) if d == p.digest => {}
            Ok(d) => {
                Found::push(failures, Failure { blob: Some(p.digest.to_string()), ..fail(FailureKind::PackDigest, format!("pack content hashes to {d}")) })
            }
            Err(e) => Found::push(failures, Failure { blob: Some(p.digest.to_string()), ..fail(FailureKind::PackUnreadable, e.to_string()) }),
        }
    }
}

/// Every stored range of `work` read (neighbours in one range request, `opts.in_flight`
/// at once) and checked against its digest (and with `--blob-digests`, every pack not in `bad_packs` re-hashed whole
/// beside them). Returns the failures, sorted, and the stored bytes checked.
fn audit_chunks(src: &dyn BlobSource, image: &Image, work: &[Work], refs: &References, bad_packs: &HashSet<u32>, opts: &AuditOptions) -> (Found, u64) {
    let algo = image.config().hash;
    let shift = image.chunk_shift();
    let name = |w: &Work| image.chain[w.link as usize].config.files[w.file as usize].name.clone();
    let bytes = AtomicU64::new(0);
    let failures = Mutex::new(Found::default());
    // Not `imgfmt::work` alone: one thread walks the packs in order beside the pool.
    std::thread::scope(|s| {
        if opts.blob_digests {
            // One thread re-hashes whole packs while the others check chunks.
            s.spawn(|| rehash_packs(src, image, bad_packs, &failures));
        }
        // Back to back only (no gap read through): a pack's bytes no chunk uses are not
        // the audit's to fetch.
        let ranges = imgfmt::source::coalesce_ranges(work, |w| (w.pack, w.at, w.at + w.stored_len as u64), 0, opts.max_range);
        for_each_index(ranges.len(), opts.threads.max(opts.in_flight).min(ranges.len()).max(1), |r, _| {
            let run = &work[ranges[r].clone()];
            let (first, last) = (&run[0], &run[run.len() - 1]);
            let pack = &image.packs[first.pack as usize].digest;
            let len = (last.at + last.stored_len as u64 - first.at) as usize;
            let base = |w: &Work| Failure {
                file: Some(name(w)),
                chunk: Some(w.chunk),
                offset: Some(w.chunk << shift),
                blob: Some(pack.to_string()),
                blob_offset: Some(w.at),
                ..fail(FailureKind::ChunkDigest, "")
            };
            let check = |w: &Work, stored: bytes::Bytes| {
                bytes.fetch_add(w.stored_len as u64, Ordering::Relaxed);
                let codec = Codec::from_code(w.codec, w.ref_pack).expect("a decoded codec");
                let reference = match codec.ref_pack() {
                    Some(rp) => match refs
                        .get(image, rp)
                        .ok_or(crate::chunk::RefError::Corrupt("its reference pack is not one the image lists".into()))
                        .and_then(|p| crate::chunk::read_reference(src, algo, &p.digest, &stored))
                    {
                        Ok(r) => Some(r),
                        Err(e) => {
                            let f = match e {
                                crate::chunk::RefError::Read(e) => {
                                    Failure { kind: FailureKind::PackUnreadable, message: format!("its reference: {e}"), ..base(w) }
                                }
                                crate::chunk::RefError::Corrupt(detail) => Failure { kind: FailureKind::ChunkCorrupt, message: detail, ..base(w) },
                            };
                            Found::push(&failures, f);
                            return;
                        }
                    },
                    None => None,
                };
                if let Err((detail, actual)) = verify_stored_ref(algo, codec, stored, w.len, &w.digest, reference.as_ref()) {
                    let f = match actual {
                        Some(a) => Failure { message: format!("digest mismatch: expected {}, got {}", w.digest, a), ..base(w) },
                        None => Failure { kind: FailureKind::ChunkCorrupt, message: detail, ..base(w) },
                    };
                    Found::push(&failures, f);
                }
            };
            match src.read_range_unverified(pack, first.at, len) {
                // Slices of the one buffer: no copy per chunk (a mapped file, an HTTP body).
                Ok(b) if b.len() == len => {
                    for w in run {
                        let at = (w.at - first.at) as usize;
                        check(w, b.slice(at..at + w.stored_len as usize));
                    }
                }
                // A range that cannot be read as a whole is read chunk by chunk, so each
                // unreadable chunk is named on its own.
                _ => {
                    for w in run {
                        match src.read_range_unverified(pack, w.at, w.stored_len as usize) {
                            Ok(b) if b.len() == w.stored_len as usize => check(w, b),
                            Ok(b) => Found::push(
                                &failures,
                                Failure { kind: FailureKind::PackUnreadable, message: format!("read {} bytes of {}", b.len(), w.stored_len), ..base(w) },
                            ),
                            Err(e) => Found::push(&failures, Failure { kind: FailureKind::PackUnreadable, message: e.to_string(), ..base(w) }),
                        }
                    }
                }
            }
        });
    });
    let mut found = failures.into_inner().expect("poisoned");
    found.list.sort_by(|a, b| (&a.file, a.chunk, &a.blob).cmp(&(&b.file, b.chunk, &b.blob)));
    (found, bytes.into_inner())
}

/// A link's outboard as read for the audit: none, the outboard, or why it could not be read.
type LinkOutboard = Option<Result<Arc<Outboard>, String>>;

/// A link's outboard, when the manifest lists one: readable and well-formed, every entry's
/// CVs merging to its digest (so its slices can be trusted once the chunk digest is), and
/// an entry for every raw chunk this link's index records that is longer than a slice (so
/// a lazy reader never falls back to whole chunks where the packer promised slices).
fn audit_outboard(link: &ChainLink, ob: LinkOutboard, base_ob: Option<&Outboard>, who: &str, shift: u8, report: &mut AuditReport) {
    let Some(desc) = &link.outboard_blob else { return };
    let blob = desc.digest.to_string();
    let ob_fail = |message: String| Failure { blob: Some(blob.clone()), ..fail(FailureKind::Outboard, message) };
    let ob = match ob {
        Some(Ok(o)) => o,
        None => return,
        Some(Err(e)) => {
            report.push_failure(ob_fail(format!("{who}: {e}")));
            return;
        }
    };
    check_outboard_entries(&ob, &blob, who, report);
    let slice = 1u64 << ob.slice_shift;
    for (fi, cf) in link.config.files.iter().enumerate() {
        for r in link.index.file_records(fi) {
            let RecordKind::Stored { codec: Codec::Raw, stored_len, .. } = r.kind else { continue };
            if u64::from(stored_len) <= slice {
                continue;
            }
            // A base's chunk may have its entry in the base's outboard instead.
            let entry = ob.find(&r.digest).or_else(|| base_ob.and_then(|b| b.find_chunk(&r.digest, stored_len)));
            let problem = match entry {
                None => format!("{who}: no outboard entry for this raw {stored_len}-byte chunk (digest {})", r.digest),
                Some(e) if e.chunk_len != stored_len => {
                    format!("{who}: outboard entry for digest {} says {} bytes, the chunk has {stored_len}", r.digest, e.chunk_len)
                }
                Some(_) => continue,
            };
            report.push_failure(Failure { file: Some(cf.name.clone()), chunk: Some(r.chunk), offset: Some(r.chunk << shift), ..ob_fail(problem) });
        }
    }
}

/// Rule 14: every entry's CVs merge to its digest.
fn check_outboard_entries(ob: &Outboard, blob: &str, who: &str, report: &mut AuditReport) {
    for i in 0..ob.entries.len() {
        let e = ob.entry(i);
        report.outboard_entries_checked += 1;
        let merged = merge_slice_cvs(e.cvs);
        if merged != e.digest {
            report.push_failure(Failure {
                blob: Some(blob.to_string()),
                ..fail(
                    FailureKind::Outboard,
                    format!("{who}: outboard entry {i}: the {} slice CVs of the {}-byte chunk {} merge to {merged}", e.cvs.len(), e.chunk_len, e.digest),
                )
            });
        }
    }
}

/// Pack sizes asked for at once (latency-bound: round trips, not CPU).
const STAT_THREADS: usize = imgfmt::source::SMALL_READS_IN_FLIGHT;

/// Run `f(i, scratch)` for every `i < n` on `threads` threads, each thread taking the next
/// index as it finishes one (chunks differ in cost) and keeping its own scratch buffer.
fn for_each_index(n: usize, threads: usize, f: impl Fn(usize, &mut Vec<u8>) + Sync) {
    imgfmt::work::for_each_index(n, threads, Vec::new, |buf, i| f(i, buf));
}

fn sha256_of_blob(src: &dyn BlobSource, d: &OciDigest, size: u64) -> Result<OciDigest, FormatError> {
    let mut h = imgfmt::digest::OciHasher::sha256();
    imgfmt::source::stream_blob_unverified::<FormatError>(src, d, size, |piece| {
        h.update(piece);
        Ok(())
    })?;
    Ok(h.finish())
}

/// Prove that `dir` holds exactly the snapshot: the same files (no more, no fewer), the
/// same sizes and modes, and every chunk hashing to the image's digest.
pub fn audit_against(image: &Image, dir: &Path, opts: &AuditOptions) -> AuditReport {
    let algo: HashAlgo = image.config().hash;
    let shift = image.chunk_shift();
    let mut report = AuditReport { images: vec![image.manifest_digest.to_string()], ..Default::default() };
    let names: HashSet<&str> = image.files.iter().map(|f| f.name.as_str()).collect();
    for extra in walk_files(dir) {
        if !names.contains(extra.as_str()) {
            report.push_failure(Failure { file: Some(extra), ..fail(FailureKind::UnexpectedFile, "not part of the snapshot") });
        }
    }
    for f in &image.files {
        let path = dir.join(&f.name);
        let meta_fail = |m: String| Failure { file: Some(f.name.clone()), ..fail(FailureKind::FileMetadata, m) };
        let file = match File::open(&path) {
            Ok(h) => h,
            Err(e) => {
                report.push_failure(meta_fail(format!("cannot open: {e}")));
                continue;
            }
        };
        let md = match file.metadata() {
            Ok(m) => m,
            Err(e) => {
                report.push_failure(meta_fail(format!("cannot stat: {e}")));
                continue;
            }
        };
        if md.len() != f.size {
            report.push_failure(meta_fail(format!("size is {}, snapshot has {}", md.len(), f.size)));
            continue;
        }
        // As packed (a source directory) or as pull and unpack apply it (less special bits
        // and write for others: spec/format.md §5).
        let mode = md.mode() & 0o7777;
        if mode != f.mode && mode != imgfmt::config::applied_mode(f.mode) {
            report.push_failure(meta_fail(format!("mode is {mode:o}, snapshot has {:o} (applied as {:o})", f.mode, imgfmt::config::applied_mode(f.mode))));
        }
        let bytes = AtomicU64::new(0);
        let failures = Mutex::new(Found::default());
        for_each_index(f.chunks.len(), opts.threads, |ci, buf| {
            let c = &f.chunks[ci];
            let off = (ci as u64) << shift;
            buf.resize(c.len as usize, 0);
            let fail_here = |m: String| Failure { file: Some(f.name.clone()), chunk: Some(ci as u64), offset: Some(off), ..fail(FailureKind::FileContent, m) };
            if let Err(e) = file.read_exact_at(buf, off) {
                Found::push(&failures, fail_here(format!("read failed: {e}")));
                return;
            }
            bytes.fetch_add(c.len as u64, Ordering::Relaxed);
            if !chunk_holds(algo, c, buf) {
                let what = match c.at {
                    StoredAt::Zero => "expected all zeros".to_string(),
                    StoredAt::Pack { .. } => format!("digest {} differs from the snapshot's {}", chunk_digest(algo, buf), c.digest),
                };
                Found::push(&failures, fail_here(what));
            }
        });
        let mut found = failures.into_inner().expect("poisoned");
        found.list.sort_by_key(|f| f.chunk);
        for f in found.list {
            report.push_failure(f);
        }
        report.failures_unlisted += found.unlisted;
        report.stored_bytes_checked += bytes.into_inner();
        report.stored_chunks_checked += f.chunks.len() as u64;
    }
    report
}

/// Whether `file` holds exactly file `fi` of `image`: its size, every stored chunk
/// hashing to its digest and every zero chunk reading as zeros. Stops at the first
/// difference; reads on `threads` threads. What lets a pull rerun keep a file a killed
/// pull had already renamed into place: the bytes are checked, whoever left them.
pub fn file_holds(image: &Image, fi: usize, file: &File, threads: usize) -> std::io::Result<bool> {
    let f = &image.files[fi];
    if file.metadata()?.len() != f.size {
        return Ok(false);
    }
    let (algo, shift) = (image.config().hash, image.chunk_shift());
    let differs = std::sync::atomic::AtomicBool::new(false);
    let error: Mutex<Option<std::io::Error>> = Mutex::new(None);
    for_each_index(f.chunks.len(), threads, |ci, buf| {
        if differs.load(Ordering::Relaxed) {
            return;
        }
        let c = &f.chunks[ci];
        buf.resize(c.len as usize, 0);
        let same = match file.read_exact_at(buf, (ci as u64) << shift) {
            Ok(()) => chunk_holds(algo, c, buf),
            Err(e) => {
                error.lock().expect("poisoned").get_or_insert(e);
                false
            }
        };
        if !same {
            differs.store(true, Ordering::Relaxed);
        }
    });
    match error.into_inner().expect("poisoned") {
        Some(e) => Err(e),
        None => Ok(!differs.into_inner()),
    }
}

/// Whether `bytes` (a whole chunk read from a file) are what the image says is there.
fn chunk_holds(algo: HashAlgo, c: &imgfmt::ResolvedChunk, bytes: &[u8]) -> bool {
    match c.at {
        StoredAt::Zero => is_zero(bytes),
        StoredAt::Pack { .. } => chunk_digest(algo, bytes) == c.digest,
    }
}

/// Regular files under `dir`, as `/`-separated relative names.
fn walk_files(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![(dir.to_path_buf(), String::new())];
    while let Some((p, prefix)) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&p) else { continue };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let rel = if prefix.is_empty() { name } else { format!("{prefix}/{name}") };
            match e.file_type() {
                Ok(t) if t.is_dir() => stack.push((e.path(), rel)),
                Ok(_) => out.push(rel),
                Err(_) => {}
            }
        }
    }
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hostile image can make every chunk fail: the report lists the first
    /// `MAX_LISTED_FAILURES` and counts the rest, and still says no.
    #[test]
    fn failures_beyond_the_listed_ones_are_counted() {
        let mut r = AuditReport::default();
        for i in 0..MAX_LISTED_FAILURES as u64 + 5 {
            r.push_failure(fail(FailureKind::ChunkDigest, format!("chunk {i}")));
        }
        assert_eq!(r.failures.len(), MAX_LISTED_FAILURES);
        assert_eq!((r.failures_unlisted, r.failure_count()), (5, MAX_LISTED_FAILURES as u64 + 5));
        assert!(!r.ok());
        let mut other = AuditReport::default();
        other.push_failure(fail(FailureKind::FileContent, "x"));
        r.merge_failures(&other);
        assert_eq!(r.failure_count(), MAX_LISTED_FAILURES as u64 + 6);
        let mut only_unlisted = AuditReport { failures_unlisted: 1, ..Default::default() };
        assert!(!only_unlisted.ok());
        only_unlisted.failures_unlisted = 0;
        assert!(only_unlisted.ok());
    }
}
