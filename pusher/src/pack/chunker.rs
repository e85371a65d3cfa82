//! Chunking: read, digest, decide (inherit, zero, dedup or store), compress and store each
//! chunk, batch after batch, beside the pack pipeline.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;

use imgfmt::compress::{compress_ref, Codec, RefHeader, REF_HEADER_LEN};
use imgfmt::index::{chunk_count, chunk_len};
use imgfmt::layout::BlobWriter;
use imgfmt::outboard::{Cv, Outboard};
use imgfmt::{ChunkDigest, Compression, HashAlgo, OciDigest, OciLayout, Role, StoredAt};
use verify::hash::is_zero;

use crate::scan::{self, Coverage, ExtentCursor};

use super::options::{io_at, PackError, PackOptions, PackReport};
use super::outboard::SliceCvs;
use super::pipeline::{hash_packs, seal_packs, write_packs, ToHasher, ToWriter};
use super::placement::{KnownChunk, Loc, Placed, PlacedChunk, Slot, Slots};

/// Level of the first pass over every new chunk with a base counterpart; only a chunk that
/// came to under a quarter of its size is compressed again at the `base_delta` level.
pub(super) const BASE_DELTA_FIRST_LEVEL: i32 = 3;
/// zstd-ref tries after which, when fewer than a quarter paid, no more base chunks are
/// read: an image packed with an unrelated `--base` reads at most this many of them.
pub(super) const BASE_DELTA_PROBATION: u64 = 32;

/// A chunk's compressed form, when compression paid.
pub(super) type Compressed = (Codec, Vec<u8>);

pub(super) struct Job {
    pub(super) chunk: u64,
    pub(super) len: u32,
    /// `None`: a hole, zero without reading; `Some(buf)`: the chunk's bytes.
    pub(super) data: Option<Vec<u8>>,
    /// Inherit from the parent without looking at the data (diff-snapshot hole).
    pub(super) inherit: bool,
    pub(super) digest: ChunkDigest,
    /// Slice CVs, when the image has an outboard and the chunk is longer than a slice.
    pub(super) cvs: Option<Vec<Cv>>,
    pub(super) zero: bool,
    /// Unchanged since the parent, but stored again: the parent has it in a pack a
    /// compaction retires.
    pub(super) compacted: bool,
}

/// Chunk `files` while the pack pipeline (see [`write_packs`]) writes what is stored:
/// returns what chunking placed and the own packs written (digest, size), in order.
pub(super) fn chunk_into_packs(
    dest: &OciLayout,
    files: &[scan::SourceFile],
    input: &ChunkInput,
    slots: &mut Slots,
    report: &mut PackReport,
) -> Result<(Chunked, Vec<(OciDigest, u64)>), PackError> {
    // Packs are written by a pipeline beside this thread (which reads and BLAKE3-hashes):
    // a writer copies each chunk into the pack file and starts its writeback, a hasher
    // runs the pack's SHA-256 (one stream, so one core: the slowest stage), and a sealer
    // fsyncs and names each finished pack, so no stage waits on another's slow part
    // (with one thread doing all three, a 2 GiB pack took 1.7 s, 0.6 s of it in fsyncs).
    // Not `imgfmt::work`: three stages joined by channels, not items shared out.
    let (tx, rx) = mpsc::sync_channel::<ToWriter>(16);
    let on_pack = input.opts.on_pack;
    let (result, own_packs) = std::thread::scope(|s| {
        let (to_hasher, hasher_rx) = mpsc::sync_channel::<ToHasher>(32);
        let (to_sealer, sealer_rx) = mpsc::sync_channel::<(BlobWriter, OciDigest)>(4);
        let writer = s.spawn(move || write_packs(dest, rx, to_hasher));
        let hasher = s.spawn(move || hash_packs(hasher_rx, to_sealer));
        let sealer = s.spawn(move || seal_packs(sealer_rx, on_pack));
        let mut r = Chunker::new(input, slots, &tx, report).all(files);
        if r.is_ok() && tx.send(ToWriter::End).is_err() {
            r = Err(PackError::Invalid("pack writer stopped early".into()));
        }
        drop(tx);
        // A stage that fails drops its receiver, and the stages before it stop
        // quietly: the one error returned is the cause.
        let stages = [writer.join(), hasher.join()].into_iter().map(|j| j.expect("pack writer thread panicked"));
        let sealed = sealer.join().expect("pack sealer thread panicked");
        let w = stages.fold(Ok(()), Result::and).and(sealed);
        (r, w)
    });
    // A writer that failed (a full disk, a file size limit) is the cause; the main thread
    // only saw it stop taking data, so its own error would hide the reason.
    let own_packs = match (&result, own_packs) {
        (Err(_), Err(e)) => return Err(e.into()),
        (_, w) => w,
    };
    let chunked = result?;
    Ok((chunked, own_packs?))
}

/// What chunking reads besides the files: the options, the parent's files by name and
/// the chunks the base and the parent chain already store.
pub(super) struct ChunkInput<'a> {
    pub(super) opts: &'a PackOptions<'a>,
    pub(super) parent_files: &'a HashMap<&'a str, &'a imgfmt::ResolvedFile>,
    pub(super) known: &'a HashMap<ChunkDigest, KnownChunk>,
    /// The chain's packs a compaction retires: a chunk the parent has there is stored
    /// again, not inherited.
    pub(super) retired: &'a HashSet<OciDigest>,
    /// The base's own outboard (at this image's slice size), when it has one.
    pub(super) base_outboard: Option<&'a Outboard>,
}

impl ChunkInput<'_> {
    /// Whether the parent's chunk `pc` lives in a retired pack.
    pub(super) fn retired(&self, pc: &imgfmt::ResolvedChunk) -> bool {
        match (pc.at, &self.opts.parent) {
            (StoredAt::Pack { pack, .. }, Some(p)) => self.retired.contains(&p.image.packs[pack as usize].digest),
            _ => false,
        }
    }
}

/// What chunking gives.
pub(super) struct Chunked {
    /// Where every chunk went.
    pub(super) placed: Placed,
    /// Stored bytes sent to own packs.
    pub(super) own_bytes: u64,
    /// Slice CVs of the raw chunks (when the image has an outboard).
    pub(super) slices: Option<SliceCvs>,
    /// Some raw chunk of the base's has its slice CVs in the base's outboard only.
    pub(super) base_outboard_used: bool,
}

/// Reads, digests and places every chunk, batch after batch, sending new chunks' bytes
/// to the pack writer; what was placed so far is what the next chunk dedups against.
pub(super) struct Chunker<'a, 'i> {
    pub(super) input: &'i ChunkInput<'a>,
    pub(super) slots: &'i mut Slots,
    pub(super) tx: &'i mpsc::SyncSender<ToWriter>,
    pub(super) report: &'i mut PackReport,
    /// Slice CVs come from the same pass over the bytes as the digest (the digest is
    /// their merge), so an outboard costs no second read of any chunk.
    pub(super) slice_shift: Option<u8>,
    pub(super) slices: Option<SliceCvs>,
    /// Chunks per batch.
    pub(super) batch: usize,
    /// Every chunk placed so far (own packs, base, chain), by digest.
    pub(super) own: HashMap<ChunkDigest, Loc>,
    pub(super) own_count: usize,
    /// The own pack being filled, and its size so far.
    pub(super) cur_slot: Option<u32>,
    pub(super) cur_off: u64,
    pub(super) total: u64,
    pub(super) base_outboard_used: bool,
    /// zstd-ref attempts so far, and those that were kept.
    pub(super) delta_tried: AtomicU64,
    pub(super) delta_paid: AtomicU64,
}

impl<'a, 'i> Chunker<'a, 'i> {
    pub(super) fn new(input: &'i ChunkInput<'a>, slots: &'i mut Slots, tx: &'i mpsc::SyncSender<ToWriter>, report: &'i mut PackReport) -> Self {
        let opts = input.opts;
        let slice_shift = opts.slice_shift.filter(|_| opts.hash == HashAlgo::Blake3);
        Chunker {
            input,
            slots,
            tx,
            report,
            slice_shift,
            slices: slice_shift.map(|s| SliceCvs::new(opts.chunk_shift, s)),
            batch: ((32u64 << 20) >> opts.chunk_shift).max(opts.threads as u64 * 2) as usize,
            own: HashMap::new(),
            own_count: 0,
            cur_slot: None,
            cur_off: 0,
            total: 0,
            base_outboard_used: false,
            delta_tried: AtomicU64::new(0),
            delta_paid: AtomicU64::new(0),
        }
    }

    /// Every file, in order.
    pub(super) fn all(mut self, files: &[scan::SourceFile]) -> Result<Chunked, PackError> {
        let mut placed = Vec::with_capacity(files.len());
        for f in files {
            placed.push(self.file(f)?);
        }
        self.report.base_delta_reads = self.delta_tried.load(Ordering::Relaxed);
        Ok(Chunked { placed, own_bytes: self.total, slices: self.slices, base_outboard_used: self.base_outboard_used })
    }

    /// One file, a batch of chunks at a time.
    pub(super) fn file(&mut self, f: &scan::SourceFile) -> Result<Vec<PlacedChunk>, PackError> {
        let opts = self.input.opts;
        let shift = opts.chunk_shift;
        let cs = 1u64 << shift;
        let file = File::open(&f.path).map_err(io_at(&f.path))?;
        // Re-stat through the open handle: the size the scan saw must still hold.
        let size = file.metadata().map_err(io_at(&f.path))?.len();
        if size != f.size {
            return Err(PackError::Invalid(format!("{}: size changed while packing ({} -> {size})", f.name, f.size)));
        }
        let extents = if size == 0 { vec![] } else { scan::data_extents(&file, size).map_err(io_at(&f.path))? };
        let mut cursor = ExtentCursor::new(&extents);
        let n = chunk_count(size, shift);
        let parent = self.input.parent_files.get(f.name.as_str()).copied();
        let diff_file = opts.diff && f.role == Role::Memory;
        if diff_file && parent.is_none_or(|p| p.size != size) {
            return Err(PackError::Invalid(format!("--diff: {} has no same-size counterpart in the parent, so its holes cannot mean 'unchanged'", f.name)));
        }
        let batch = self.batch as u64;
        let mut slots_of_file: Vec<PlacedChunk> = Vec::with_capacity(n as usize);
        let mut c = 0u64;
        imgfmt::file::will_need(&file, 0, batch * cs);
        while c < n {
            let end_c = (c + batch).min(n);
            // The batch after this one starts coming in from disk while this one is
            // hashed and written (a source not in the page cache cost a 2 GiB push 0.5 s
            // of waiting on synchronous 1 MiB reads).
            imgfmt::file::will_need(&file, end_c * cs, batch * cs);
            let mut jobs = self.read(f, &file, &mut cursor, c..end_c, diff_file)?;
            self.digest(&mut jobs);
            let (mut decided, to_store) = self.decide(f, parent, &mut jobs)?;
            let compressed = self.compress(f, &jobs, to_store);
            self.store(&mut jobs, compressed, &mut decided)?;
            // Duplicates within the batch pointed at placeholders: resolve them now.
            for (digest, l) in decided.iter_mut().flatten().filter_map(|(d, l)| l.as_mut().map(|l| (d, l))) {
                if l.slot == u32::MAX {
                    *l = self.own[digest];
                }
            }
            for j in &jobs {
                if let Some(p) = opts.progress {
                    p(j.len as u64);
                }
            }
            self.report.logical_bytes += jobs.iter().map(|j| j.len as u64).sum::<u64>();
            slots_of_file.extend(decided);
            c = end_c;
        }
        Ok(slots_of_file)
    }

    /// Read phase: the bytes of chunks `range` of `f` (holes are not read; a diff
    /// snapshot's partly written chunk is merged over the parent's).
    pub(super) fn read(
        &mut self,
        f: &scan::SourceFile,
        file: &File,
        cursor: &mut ExtentCursor,
        range: std::ops::Range<u64>,
        diff_file: bool,
    ) -> Result<Vec<Job>, PackError> {
        let opts = self.input.opts;
        let shift = opts.chunk_shift;
        let cs = 1u64 << shift;
        let mut jobs = Vec::with_capacity((range.end - range.start) as usize);
        for ci in range {
            let len = chunk_len(f.size, shift, ci);
            let start = ci * cs;
            let cov = cursor.coverage(start, start + len);
            let mut job =
                Job { chunk: ci, len: len as u32, data: None, inherit: false, digest: ChunkDigest::default(), cvs: None, zero: false, compacted: false };
            // A diff snapshot's hole over a chunk a compaction retires: the parent's bytes
            // are stored again, so they are read (and checked) from the parent.
            let retired =
                diff_file && self.input.parent_files.get(f.name.as_str()).and_then(|p| p.chunks.get(ci as usize)).is_some_and(|pc| self.input.retired(pc));
            match (cov, diff_file) {
                (Coverage::Hole, true) if !retired => job.inherit = true,
                (Coverage::Hole, false) => job.zero = true,
                (Coverage::Partial | Coverage::Hole, true) => {
                    // Dirty pages over the parent's chunk: merge here, per chunk,
                    // without ever materialising the merged file.
                    let p = opts.parent.as_ref().expect("diff has parent");
                    let (pfi, _) = p.image.file(&f.name).expect("checked above");
                    let mut buf = verify::read_chunk(p.source, &p.image, pfi, ci)?.into_vec();
                    for (s, e) in cursor.pieces(start, start + len) {
                        file.read_exact_at(&mut buf[(s - start) as usize..(e - start) as usize], s).map_err(io_at(&f.path))?;
                        self.report.bytes_read += e - s;
                    }
                    job.data = Some(buf);
                }
                _ => {
                    let mut buf = vec![0u8; len as usize];
                    file.read_exact_at(&mut buf, start).map_err(io_at(&f.path))?;
                    self.report.bytes_read += len;
                    job.data = Some(buf);
                }
            }
            jobs.push(job);
        }
        Ok(jobs)
    }

    /// Digest phase, in parallel: each chunk's digest (and slice CVs); chunks of zeros
    /// found.
    pub(super) fn digest(&self, jobs: &mut [Job]) {
        let (algo, slice_shift) = (self.input.opts.hash, self.slice_shift);
        imgfmt::work::for_each_mut(jobs, self.input.opts.threads, |j| {
            if let Some(d) = &j.data {
                if is_zero(d) {
                    j.zero = true;
                    j.data = None;
                } else if let Some(s) = slice_shift {
                    (j.digest, j.cvs) = verify::hash::digest_with_slice_cvs(d, s);
                } else {
                    j.digest = verify::chunk_digest(algo, d);
                }
            }
            if j.zero {
                j.digest = verify::zero_digest(algo, j.len);
            }
        });
    }

    /// Decide phase: inherit, zero, dedup or store, per chunk. Returns the placements
    /// (new chunks at a placeholder) and which jobs hold new content.
    pub(super) fn decide(
        &mut self,
        f: &scan::SourceFile,
        parent: Option<&imgfmt::ResolvedFile>,
        jobs: &mut [Job],
    ) -> Result<(Vec<PlacedChunk>, Vec<usize>), PackError> {
        let opts = self.input.opts;
        let mut to_store: Vec<usize> = Vec::new();
        let mut decided: Vec<PlacedChunk> = Vec::with_capacity(jobs.len());
        for (k, j) in jobs.iter_mut().enumerate() {
            self.report.chunks += 1;
            let pc = parent.and_then(|p| p.chunks.get(j.chunk as usize)).filter(|pc| pc.len == j.len);
            j.compacted = pc.is_some_and(|pc| pc.digest == j.digest && self.input.retired(pc));
            if j.inherit || (pc.is_some_and(|pc| pc.digest == j.digest) && !j.compacted) {
                if pc.is_none() {
                    return Err(PackError::Invalid(format!("--diff: {} chunk {} is a hole but the parent has no such chunk", f.name, j.chunk)));
                }
                self.report.inherited_chunks += 1;
                decided.push(None);
                continue;
            }
            if j.zero {
                self.report.zero_chunks += 1;
                decided.push(Some((j.digest, None)));
                continue;
            }
            if let Some(l) = self.own.get(&j.digest) {
                self.report.deduplicated_chunks += 1;
                decided.push(Some((j.digest, Some(*l))));
                continue;
            }
            if let Some(kc) = self.input.known.get(&j.digest) {
                let slot = self.slots.foreign(&kc.pack, kc.owner, kc.from_base, || {
                    if kc.from_base { &opts.base } else { &opts.parent }
                        .as_ref()
                        .and_then(|r| r.image.packs.iter().find(|p| p.digest == kc.pack))
                        .map(|p| p.size)
                        .unwrap_or(0)
                });
                // A `zstd-ref` chunk brings its reference's pack along (same owner, same source).
                let codec = match &kc.ref_pack {
                    Some((d, size)) => Codec::ZstdRef(self.slots.foreign(d, kc.owner, kc.from_base, || *size)),
                    None => kc.codec,
                };
                let l = Loc { slot, offset: kc.offset, stored_len: kc.stored_len, codec };
                self.own.insert(j.digest, l);
                let in_base_outboard = kc.from_base && self.input.base_outboard.and_then(|o| o.find_chunk(&j.digest, j.len)).is_some();
                if in_base_outboard {
                    self.base_outboard_used = true;
                } else if let (Codec::Raw, Some(s), Some(cvs)) = (kc.codec, self.slices.as_mut(), j.cvs.take()) {
                    s.insert(j.digest, j.len, cvs);
                }
                self.report.deduplicated_chunks += 1;
                decided.push(Some((j.digest, Some(l))));
                continue;
            }
            // New content: placeholder location, filled after compression. Mark it in
            // `own` right away so a duplicate later in this batch dedups against it.
            to_store.push(k);
            self.own.insert(j.digest, Loc { slot: u32::MAX, offset: k as u64, stored_len: 0, codec: Codec::Raw });
            decided.push(Some((j.digest, None)));
        }
        Ok((decided, to_store))
    }

    /// Compress phase, in parallel, for new chunks only: (job, compressed form when
    /// compression paid, the reference's pack when that form is `zstd-ref`).
    pub(super) fn compress(&self, f: &scan::SourceFile, jobs: &[Job], to_store: Vec<usize>) -> Vec<(usize, Option<Compressed>, Option<OciDigest>)> {
        let opts = self.input.opts;
        let compression = opts.compression;
        let base = opts.base.as_ref().zip(opts.base_delta).and_then(|(b, level)| b.image.file(&f.name).map(|(bfi, bf)| (b, bfi, bf, level)));
        let mut compressed: Vec<(usize, Option<Compressed>, Option<OciDigest>)> = to_store.into_iter().map(|k| (k, None, None)).collect();
        if compression == Compression::None && base.is_none() {
            return compressed;
        }
        imgfmt::work::for_each_mut(&mut compressed, opts.threads, |(k, out, ref_pack)| {
            let j = &jobs[*k];
            let data = j.data.as_deref().expect("stored chunk has data");
            *out = compression.compress(data);
            let Some((b, bfi, bf, level)) = base else { return };
            // The base's chunk at this position, when it is stored (not zero, not itself
            // a `zstd-ref` chunk: a reference is one read, never a chain of them).
            let Some(bc) = bf.chunks.get(j.chunk as usize) else { return };
            let StoredAt::Pack { pack, offset, stored_len, codec } = bc.at else { return };
            if codec.ref_pack().is_some() {
                return;
            }
            // An image that is no close relative of its base (most tries not paying) stops
            // reading the base's chunks: from a remote base each is a range request.
            let (tried, paid) = (self.delta_tried.load(Ordering::Relaxed), self.delta_paid.load(Ordering::Relaxed));
            if tried >= BASE_DELTA_PROBATION && paid * 4 < tried {
                return;
            }
            self.delta_tried.fetch_add(1, Ordering::Relaxed);
            let reference = match verify::read_chunk(b.source, &b.image, bfi, j.chunk) {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!("{} chunk {}: the base's chunk there could not be read ({e}); stored without it", f.name, j.chunk);
                    return;
                }
            };
            let best = out.as_ref().map_or(data.len(), |(_, b)| b.len());
            // A fast pass first: most chunks are either unrelated to their base's (not
            // worth more CPU) or close to it; only a close one is compressed again at
            // `level`, where the optimal parser halves a shifted state file's delta.
            let Some(mut frame) = compress_ref(data, reference.as_bytes(), level.min(BASE_DELTA_FIRST_LEVEL), true) else { return };
            if level > BASE_DELTA_FIRST_LEVEL && frame.len() * 4 < data.len() {
                if let Some(better) = compress_ref(data, reference.as_bytes(), level, false).filter(|b| b.len() < frame.len()) {
                    frame = better;
                }
            }
            if REF_HEADER_LEN + frame.len() < best {
                self.delta_paid.fetch_add(1, Ordering::Relaxed);
                let h = RefHeader { offset, stored_len, len: bc.len, codec, digest: bc.digest };
                let mut bytes = Vec::with_capacity(REF_HEADER_LEN + frame.len());
                bytes.extend_from_slice(&h.encode());
                bytes.extend_from_slice(&frame);
                *out = Some((Codec::ZstdRef(u32::MAX), bytes));
                *ref_pack = Some(b.image.packs[pack as usize].digest.clone());
            }
        });
        compressed
    }

    /// Write phase: place each new chunk in the current own pack (a new one when it
    /// would pass the pack size), send its bytes to the writer, and record where it went.
    pub(super) fn store(
        &mut self,
        jobs: &mut [Job],
        compressed: Vec<(usize, Option<Compressed>, Option<OciDigest>)>,
        decided: &mut [PlacedChunk],
    ) -> Result<(), PackError> {
        let writer_gone = || PackError::Invalid("pack writer stopped early".into());
        let opts = self.input.opts;
        let pack_size = opts.pack_size;
        for (k, comp, ref_pack) in compressed {
            let j = &mut jobs[k];
            let (codec, bytes) = match comp {
                Some((Codec::ZstdRef(_), b)) => {
                    let d = ref_pack.expect("a zstd-ref chunk names its reference's pack");
                    let slot = self.slots.foreign(&d, "base", true, || {
                        opts.base.as_ref().and_then(|r| r.image.packs.iter().find(|p| p.digest == d)).map(|p| p.size).unwrap_or(0)
                    });
                    self.report.base_delta_chunks += 1;
                    self.report.base_delta_bytes += b.len() as u64;
                    (Codec::ZstdRef(slot), b)
                }
                Some((codec, b)) => (codec, b),
                None => (Codec::Raw, j.data.take().expect("stored chunk has data")),
            };
            let stored_len = bytes.len() as u64;
            if self.cur_slot.is_none() || (self.cur_off > 0 && self.cur_off + stored_len > pack_size) {
                if self.cur_slot.is_some() {
                    self.tx.send(ToWriter::Rollover).map_err(|_| writer_gone())?;
                }
                self.slots.list.push(Slot::Own(self.own_count));
                self.own_count += 1;
                self.cur_slot = Some((self.slots.list.len() - 1) as u32);
                self.cur_off = 0;
            }
            let l = Loc { slot: self.cur_slot.expect("set"), offset: self.cur_off, stored_len: stored_len as u32, codec };
            self.cur_off += stored_len;
            self.total += stored_len;
            self.tx.send(ToWriter::Data(bytes)).map_err(|_| writer_gone())?;
            self.own.insert(j.digest, l);
            if let (Codec::Raw, Some(s), Some(cvs)) = (codec, self.slices.as_mut(), j.cvs.take()) {
                s.insert(j.digest, j.len, cvs);
            }
            decided[k] = Some((j.digest, Some(l)));
            self.report.stored_chunks += 1;
            if j.compacted {
                self.report.compacted_chunks += 1;
                self.report.compacted_bytes += stored_len;
            }
        }
        Ok(())
    }
}
