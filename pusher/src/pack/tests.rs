use super::chunker::*;
use super::options::*;
use super::outboard::*;
use super::pipeline::*;
use super::*;
use imgfmt::compress::Codec;
use imgfmt::config::MAX_CHAIN_DEPTH;
use imgfmt::{BlobSource, ChunkDigest, FormatError, HashAlgo, Image, OciDigest, OciLayout, RecordKind, StoredAt};
use std::path::Path;
use std::sync::mpsc;
use std::sync::Mutex;

/// What the sealer returned, the packs announced, and the file names left in the layout.
type Outcome = (Result<Vec<(OciDigest, u64)>, FormatError>, Vec<OciDigest>, Vec<String>);

/// Run the three pack-writing stages on `msgs`, as `pack` does.
fn run_pipeline(msgs: Vec<ToWriter>) -> Outcome {
    let dir = tempfile::tempdir().unwrap();
    let layout = OciLayout::open_or_create(dir.path()).unwrap();
    let announced = Mutex::new(Vec::new());
    let on_pack = |d: &OciDigest, _: u64| announced.lock().unwrap().push(d.clone());
    // The pack pipeline's three stages, as in `chunk_into_packs` (not a worker pool).
    let done = std::thread::scope(|s| {
        let (tx, rx) = mpsc::sync_channel(1);
        let (to_hasher, hasher_rx) = mpsc::sync_channel(1);
        let (to_sealer, sealer_rx) = mpsc::sync_channel(1);
        let w = s.spawn(|| write_packs(&layout, rx, to_hasher));
        let h = s.spawn(|| hash_packs(hasher_rx, to_sealer));
        let sealer = s.spawn(|| seal_packs(sealer_rx, Some(&on_pack)));
        for m in msgs {
            tx.send(m).unwrap();
        }
        drop(tx);
        w.join().unwrap().unwrap();
        h.join().unwrap().unwrap();
        sealer.join().unwrap()
    });
    let mut names: Vec<String> = std::fs::read_dir(dir.path().join("blobs/sha256")).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    names.sort();
    (done, announced.into_inner().unwrap(), names)
}

/// An outboard that would pass its limit doubles its slices (CV pairs merged, chunks
/// now of one slice dropped) until it fits, and what it keeps is what hashing at the
/// larger slice gives; past half a chunk per slice there is no outboard at all.
#[test]
fn slice_cvs_past_the_limit_are_coarsened_until_they_fit() {
    let data: Vec<Vec<u8>> = (0..6u8).map(|k| (0..65536u32).map(|i| (i.wrapping_mul(2654435761) >> 7) as u8 ^ k).collect()).collect();
    let lens = [65536usize, 65536, 65536, 40000, 9000, 5000];
    let mut s = SliceCvs::new(16, 12);
    // Room for the header and about 40 CVs: 4 KiB slices (16 per full chunk) do not fit.
    s.limit = 32 + 6 * 48 + 40 * 32;
    for (d, &len) in data.iter().zip(&lens) {
        let (digest, cvs) = verify::hash::digest_with_slice_cvs(&d[..len], 12);
        s.insert(digest, len as u32, cvs.unwrap());
    }
    assert!(s.bytes <= s.limit, "{} > {}", s.bytes, s.limit);
    assert_eq!(s.shift, 13, "8 KiB slices: 8+8+8+5+2 CVs");
    assert_eq!(s.bytes, 32 + 5 * 48 + 31 * 32);
    assert_eq!(s.by_digest.len(), 5, "the 5000-byte chunk is one slice now");
    for (d, &len) in data.iter().zip(&lens) {
        let digest = verify::chunk_digest(HashAlgo::Blake3, &d[..len]);
        if let Some((l, cvs)) = s.by_digest.get(&digest) {
            assert_eq!(*l as usize, len);
            assert_eq!(cvs, &verify::hash::slice_cvs(&d[..len], 13));
            assert_eq!(verify::hash::merge_slice_cvs(cvs), digest);
        }
    }
    // A chunk hashed later at 4 KiB is kept at the current size.
    let late: Vec<u8> = (0..30000u32).map(|i| (i * 7) as u8).collect();
    let (digest, cvs) = verify::hash::digest_with_slice_cvs(&late, 12);
    s.insert(digest, 30000, cvs.unwrap());
    assert_eq!(s.by_digest[&digest].1, verify::hash::slice_cvs(&late, s.shift));
    // A limit nothing fits under leaves no outboard.
    let mut none = SliceCvs::new(16, 12);
    none.limit = 100;
    let (digest, cvs) = verify::hash::digest_with_slice_cvs(&data[0], 12);
    none.insert(digest, 65536, cvs.unwrap());
    assert!(none.by_digest.is_empty());
    assert_eq!(none.shift, 16);
}

#[test]
fn packs_are_named_by_their_bytes_in_order() {
    let (a, b) = (vec![1u8; 3000], vec![2u8; 5000]);
    let msgs = vec![ToWriter::Data(a[..1000].to_vec()), ToWriter::Data(a[1000..].to_vec()), ToWriter::Rollover, ToWriter::Data(b.clone()), ToWriter::End];
    let (done, announced, names) = run_pipeline(msgs);
    let want = vec![(OciDigest::of(&a), 3000), (OciDigest::of(&b), 5000)];
    assert_eq!(done.unwrap(), want);
    assert_eq!(announced, vec![want[0].0.clone(), want[1].0.clone()]);
    let mut want_names: Vec<String> = want.iter().map(|(d, _)| d.hex().to_string()).collect();
    want_names.sort();
    assert_eq!(names, want_names);
}

/// A packing that fails stops sending without `End`: the pack it was filling is
/// removed, never named; packs sealed before stay (complete, content-addressed).
#[test]
fn a_pack_left_open_by_a_failed_packing_is_discarded() {
    let (a, b) = (vec![1u8; 3000], vec![2u8; 5000]);
    let (done, announced, names) = run_pipeline(vec![ToWriter::Data(a.clone()), ToWriter::Rollover, ToWriter::Data(b)]);
    assert_eq!(done.unwrap(), vec![(OciDigest::of(&a), 3000)]);
    assert_eq!(announced, vec![OciDigest::of(&a)]);
    assert_eq!(names, vec![OciDigest::of(&a).hex().to_string()], "no temp file, no second pack");
}

fn noise(n: usize, mut x: u64) -> Vec<u8> {
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// An image packed with a base it is no close relative of reads 32 of the base's
/// chunks trying zstd-ref, then stops; one whose chunks are each the base's with a few
/// bytes changed reads (and stores as zstd-ref) every one.
#[test]
fn regression_issue_22_an_unrelated_base_is_read_only_on_probation() {
    let t = tempfile::tempdir().unwrap();
    let layout = OciLayout::open_or_create(t.path().join("layout")).unwrap();
    let base_mem = noise(100 << 16, 1);
    let (base, far, near) = (t.path().join("base"), t.path().join("far"), t.path().join("near"));
    for (d, mem) in [
        (&base, base_mem.clone()),
        (&far, noise(100 << 16, 2)),
        (&near, {
            let mut m = base_mem.clone();
            for c in 0..100 {
                m[(c << 16) + 17] ^= 0xff;
            }
            m
        }),
    ] {
        std::fs::create_dir_all(d).unwrap();
        std::fs::write(d.join("mem"), mem).unwrap();
    }
    pack(&base, &layout, "base", &PackOptions { chunk_shift: 16, threads: 2, ..Default::default() }).unwrap();
    let with_base = |dir: &Path, tag: &str| {
        let b = Related { source: &layout, image: open(&layout, "base"), reference: "base".into() };
        pack(dir, &layout, tag, &PackOptions { chunk_shift: 16, threads: 2, base: Some(b), ..Default::default() }).unwrap()
    };
    let r = with_base(&far, "far");
    assert_eq!((r.stored_chunks, r.base_delta_chunks), (100, 0));
    // Tries run two at a time, so a few may start before the count says stop.
    assert!((BASE_DELTA_PROBATION..BASE_DELTA_PROBATION + 4).contains(&r.base_delta_reads), "{} base chunks read", r.base_delta_reads);
    let r = with_base(&near, "near");
    assert_eq!((r.stored_chunks, r.base_delta_chunks, r.base_delta_reads), (100, 100, 100));
}

/// A snapshot directory: `mem` of 8 chunks of 64 KiB (chunk `i` filled with `fill[i]`,
/// 0 = zeros) and a small `state`.
fn snapshot(dir: &Path, fill: &[u8; 8]) {
    std::fs::create_dir_all(dir).unwrap();
    let mem: Vec<u8> = fill.iter().flat_map(|b| std::iter::repeat_n(*b, 1 << 16)).collect();
    std::fs::write(dir.join("mem"), mem).unwrap();
    std::fs::write(dir.join("state"), b"state").unwrap();
}

fn open(layout: &OciLayout, tag: &str) -> Image {
    Image::open(layout, &layout.resolve_tag(tag).unwrap()).unwrap()
}

/// Pack `dir` as `tag`, a layer over `parent` (a tag of the same layout) if given.
fn pack_as(dir: &Path, layout: &OciLayout, tag: &str, parent: Option<&str>, max_chain: usize) -> Result<PackReport, PackError> {
    let parent = parent.map(|p| Related { source: layout, image: open(layout, p), reference: p.to_string() });
    let opts = PackOptions { chunk_shift: 16, parent, max_chain, threads: 2, ..Default::default() };
    pack(dir, layout, tag, &opts)
}

/// Every resolved chunk's digest and where its bytes are (pack digest, offset).
fn located(img: &Image) -> Vec<(ChunkDigest, Option<(OciDigest, u64)>)> {
    img.files
        .iter()
        .flat_map(|f| &f.chunks)
        .map(|c| match c.at {
            StoredAt::Zero => (c.digest, None),
            StoredAt::Pack { pack, offset, .. } => (c.digest, Some((img.packs[pack as usize].digest.clone(), offset))),
        })
        .collect()
}

fn blobs(dir: &Path) -> std::collections::BTreeSet<String> {
    std::fs::read_dir(dir.join("blobs/sha256")).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect()
}

/// The layer that would have 65 ancestors is rebased: no parent, a full index whose
/// records point where the chain stored each chunk (no pack copied or written for
/// them), the same content root a layer of that content has; it verifies, and the
/// next layer starts a new chain over it.
#[test]
fn the_layer_past_the_chain_limit_is_rebased_onto_the_chains_packs() {
    let dir = tempfile::tempdir().unwrap();
    let layout = OciLayout::open_or_create(dir.path().join("layout")).unwrap();
    let src = dir.path().join("src");
    let mut fill = [1, 2, 0, 4, 5, 0, 7, 8];
    snapshot(&src, &fill);
    assert_eq!(pack_as(&src, &layout, "l0", None, MAX_CHAIN_DEPTH).unwrap().chain_depth, 0);
    for i in 1..=MAX_CHAIN_DEPTH + 2 {
        fill[i % 8] = 10 + i as u8; // one chunk changes per layer
        snapshot(&src, &fill);
        let before = blobs(layout.root());
        let parent = open(&layout, &format!("l{}", i - 1));
        let r = pack_as(&src, &layout, &format!("l{i}"), Some(&format!("l{}", i - 1)), MAX_CHAIN_DEPTH).unwrap();
        let img = open(&layout, &format!("l{i}"));
        if i <= MAX_CHAIN_DEPTH {
            assert_eq!((r.rebased, r.chain_depth, img.chain.len()), (false, i, i + 1), "layer {i}");
            continue;
        }
        if i == MAX_CHAIN_DEPTH + 2 {
            assert_eq!((r.rebased, r.chain_depth, img.chain.len()), (false, 1, 2), "a new chain over the rebased image");
            continue;
        }
        assert!(r.rebased && r.chain_depth == 0, "layer {i}: {r:?}");
        assert_eq!(r.rebased_from.as_deref(), Some(parent.manifest_digest.as_str()));
        assert_eq!(img.manifest.annotations.get(media::ANN_REBASED_FROM).map(String::as_str), Some(parent.manifest_digest.as_str()));
        assert_eq!(img.chain.len(), 1, "no parent link");
        assert!(!img.index().layer && img.config().parent.is_none());
        // One chunk changed: one new pack of one chunk; every other chunk where the
        // chain had it.
        assert_eq!((r.packs, r.pack_bytes, r.stored_chunks), (1, 1 << 16, 1));
        let (want, got) = (located(&parent), located(&img));
        let differ: Vec<usize> = (0..want.len()).filter(|&k| want[k] != got[k]).collect();
        assert_eq!(differ, vec![i % 8], "only the changed chunk is elsewhere");
        let added: Vec<String> = blobs(layout.root()).difference(&before).cloned().collect();
        // ... and its outboard: slice CVs of its records, most from the chain's outboards.
        let outboards = img.manifest.layers.iter().filter(|d| d.media_type == media::OUTBOARD).count();
        assert_eq!(outboards, 1, "a rebased image has an outboard of its own");
        let raw: std::collections::HashSet<_> = img
            .index()
            .records
            .iter()
            .filter(|r| matches!(r.kind, RecordKind::Stored { codec: Codec::Raw, stored_len, .. } if stored_len > 4096))
            .map(|r| r.digest)
            .collect();
        let ob = img.chain[0].read_outboard(&layout).unwrap().expect("an outboard");
        assert!(raw.iter().all(|d| ob.find(d).is_some()), "every raw chunk of the rebased index has its slice CVs ({} of {})", ob.entries.len(), raw.len());
        assert_eq!(added.len(), 5, "new pack, index, outboard, config, manifest only: {added:?}");
        let owned = |o: &str| img.manifest.layers.iter().filter(|d| d.media_type == media::PACK && d.annotations[media::ANN_OWNER] == o).count();
        assert_eq!((owned("self"), owned(media::OWNER_REBASED), r.chain_packs_referenced), (1, img.packs.len() - 1, img.packs.len() - 1));
        assert!(!img.manifest.layers.iter().any(|d| d.media_type == media::CONFIG), "no ancestor is listed");
        let audit = verify::audit(&layout, &img, &verify::AuditOptions { threads: 2, blob_digests: true, ..Default::default() }).unwrap();
        assert!(audit.ok(), "{:?}", audit.failures);
        assert_eq!(audit.stored_chunks_checked, 9, "every stored chunk verified (by now all 8 of mem, and state)");
    }
}

/// A lower limit rebases earlier; the rebased image's content root equals that of the
/// layer it replaces (same content, same root), and an unchanged directory rebases
/// into metadata alone.
#[test]
fn max_chain_rebases_earlier_with_the_same_root_and_no_new_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let layout = OciLayout::open_or_create(dir.path().join("layout")).unwrap();
    let src = dir.path().join("src");
    snapshot(&src, &[1, 2, 3, 0, 0, 6, 7, 8]);
    pack_as(&src, &layout, "l0", None, 2).unwrap();
    snapshot(&src, &[1, 9, 3, 0, 0, 6, 7, 8]);
    pack_as(&src, &layout, "l1", Some("l0"), 2).unwrap();
    snapshot(&src, &[1, 9, 3, 0, 11, 6, 7, 8]);
    assert_eq!(pack_as(&src, &layout, "l2", Some("l1"), 2).unwrap().chain_depth, 2);
    snapshot(&src, &[1, 9, 3, 12, 11, 6, 7, 8]);
    let layer = pack_as(&src, &layout, "layer", Some("l2"), 3).unwrap();
    let rebased = pack_as(&src, &layout, "rebased", Some("l2"), 2).unwrap();
    assert_eq!((layer.rebased, layer.chain_depth, rebased.rebased, rebased.chain_depth), (false, 3, true, 0));
    assert_eq!(rebased.root, layer.root);
    assert_eq!(located(&open(&layout, "rebased")), located(&open(&layout, "layer")), "same chunks in the same places");

    // Nothing changed: no pack at all, only index, config and manifest.
    let before = blobs(layout.root());
    let again = pack_as(&src, &layout, "again", Some("layer"), 0).unwrap();
    assert!(again.rebased && again.packs == 0 && again.pack_bytes == 0, "{again:?}");
    assert_eq!(blobs(layout.root()).difference(&before).count(), 3);
    assert_eq!(again.root, layer.root);
}

/// Packs a full read of `img` touches.
fn packs_read(img: &Image) -> std::collections::BTreeSet<OciDigest> {
    located(img).into_iter().filter_map(|(_, at)| at.map(|(p, _)| p)).collect()
}

/// Issue 22 §6: a long history is compacted. Layers that each change one chunk, with
/// `compact_after` 2: no image reads from more than 2 packs beyond the fewest its
/// bytes need (without compaction the 30th reads from 9, one per chunk); a compacted
/// image stores again only unchanged chunks of the packs it retires, its manifest
/// lists none of them (retention may free them once older images go), it has the
/// root an uncompacted image of the same content has, and it verifies.
#[test]
fn regression_issue_22_a_long_history_is_compacted_into_few_packs() {
    let dir = tempfile::tempdir().unwrap();
    let layout = OciLayout::open_or_create(dir.path().join("layout")).unwrap();
    let src = dir.path().join("src");
    let mut fill = [1, 2, 3, 4, 5, 6, 7, 8];
    snapshot(&src, &fill);
    pack_as(&src, &layout, "l0", None, MAX_CHAIN_DEPTH).unwrap();
    let mut compactions = 0;
    for i in 1..=30usize {
        fill[i % 8] = 20 + i as u8;
        snapshot(&src, &fill);
        let parent = Related { source: &layout, image: open(&layout, &format!("l{}", i - 1)), reference: String::new() };
        let opts = PackOptions { chunk_shift: 16, parent: Some(parent), compact_after: Some(2), threads: 2, ..Default::default() };
        let r = pack(&src, &layout, &format!("l{i}"), &opts).unwrap();
        let img = open(&layout, &format!("l{i}"));
        let read = packs_read(&img);
        // All of this image's bytes fit one pack: at most 1 + 2 packs.
        assert!(read.len() <= 3, "layer {i} reads from {} packs: {r:?}", read.len());
        assert_eq!(r.excess_packs, read.len() - 1, "layer {i}");
        let listed: std::collections::BTreeSet<OciDigest> =
            img.manifest.layers.iter().filter(|d| d.media_type == media::PACK).map(|d| d.digest.clone()).collect();
        assert_eq!(listed, read, "layer {i}: the manifest lists exactly the packs the image reads");
        if r.compacted {
            compactions += 1;
            assert!(r.compacted_chunks >= 1 && r.packs_retired >= 1, "{r:?}");
            // Only the changed chunk is new content; the rest was stored before.
            assert_eq!(r.stored_chunks, r.compacted_chunks + 1, "{r:?}");
            let parent = open(&layout, &format!("l{}", i - 1));
            let plain = PackOptions {
                chunk_shift: 16,
                parent: Some(Related { source: &layout, image: parent, reference: String::new() }),
                compact_after: None,
                threads: 2,
                ..Default::default()
            };
            let uncompacted = pack(&src, &layout, "plain", &plain).unwrap();
            assert_eq!(uncompacted.root, r.root, "same content, same root");
            assert!(packs_read(&open(&layout, "plain")).len() > read.len());
        }
        let audit = verify::audit(&layout, &img, &verify::AuditOptions { threads: 2, ..Default::default() }).unwrap();
        assert!(audit.ok(), "layer {i}: {:?}", audit.failures);
    }
    assert!(compactions >= 5, "{compactions} compactions in 30 layers");
}

#[test]
fn max_chain_past_what_readers_open_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let layout = OciLayout::open_or_create(dir.path().join("layout")).unwrap();
    let src = dir.path().join("src");
    snapshot(&src, &[1; 8]);
    let err = pack_as(&src, &layout, "l0", None, MAX_CHAIN_DEPTH + 1).unwrap_err();
    assert!(err.to_string().contains("--max-chain 65"), "{err}");
}
