//! Long parent chains (issue 13 §2): a sandbox hibernated every few minutes makes one
//! layer each time. Readers open at most 64 ancestors, so the layer that would have 65 is
//! *rebased*: a full index pointing into the packs the chain already stored, no parent,
//! nothing stored or sent again; the next layer starts a new chain over it.

use std::collections::BTreeSet;
use std::fs;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use imgfmt::{media, BlobSource, Image, Manifest, OciLayout};
use snapctl_tests::registry_support::Serve;
use snapctl_tests::{run, snapctl, Run, SplitMix64};

/// Chunk size of every image here: the smallest, so one mutation is one small chunk.
const CHUNK: usize = 64 << 10;
/// vm.mem: 32 chunks.
const MEM: usize = 2 << 20;
/// The chain limit readers enforce (`imgfmt::config::MAX_CHAIN_DEPTH`).
const LIMIT: usize = 64;

/// A snapshot directory whose vm.mem changes one chunk per "hibernation".
struct Snapshot {
    dir: PathBuf,
}

impl Snapshot {
    fn new(dir: PathBuf) -> Snapshot {
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("vm.mem"), Snapshot::initial_mem()).unwrap();
        fs::write(dir.join("vm.state"), b"device state, unchanged across hibernations\n".repeat(100)).unwrap();
        Snapshot { dir }
    }

    /// vm.mem before the first mutation.
    fn initial_mem() -> Vec<u8> {
        let mut rng = SplitMix64(13);
        (0..MEM / 8).flat_map(|_| rng.next_u64().to_le_bytes()).collect()
    }

    /// Layer `i`'s change: one chunk rewritten (a different one each time, every chunk
    /// over a run), as (offset, bytes).
    fn mutation(i: u64) -> (u64, Vec<u8>) {
        let chunk = (i * 7) % (MEM / CHUNK) as u64;
        let mut rng = SplitMix64(1000 + i);
        (chunk * CHUNK as u64, (0..CHUNK / 8).flat_map(|_| rng.next_u64().to_le_bytes()).collect())
    }

    /// Layer `i`: rewrite one chunk.
    fn mutate(&self, i: u64) {
        let (at, bytes) = Snapshot::mutation(i);
        let f = fs::OpenOptions::new().write(true).open(self.dir.join("vm.mem")).unwrap();
        f.write_all_at(&bytes, at).unwrap();
    }

    fn mem(&self) -> Vec<u8> {
        fs::read(self.dir.join("vm.mem")).unwrap()
    }
}

/// The chain depth layer `i` must have: one more than its parent, unless that would pass
/// the limit, where the chain starts over (0: a full image).
fn expected_depths(n: usize, limit: usize) -> Vec<usize> {
    let mut d = vec![0];
    for _ in 1..=n {
        let next = d.last().unwrap() + 1;
        d.push(if next > limit { 0 } else { next });
    }
    d
}

fn ok(cmd: &mut std::process::Command) -> Run {
    let r = run(cmd);
    assert_eq!(r.code, 0, "{cmd:?}: {r:?}");
    r
}

fn json(r: &Run) -> serde_json::Value {
    serde_json::from_str(&r.stdout).unwrap_or_else(|e| panic!("no JSON on stdout ({e}): {r:?}"))
}

/// Every blob digest `snapctl serve` holds under `storage`.
fn stored_blobs(storage: &Path) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let Ok(prefixes) = fs::read_dir(storage.join("blobs/sha256")) else { return out };
    for prefix in prefixes {
        for b in fs::read_dir(prefix.unwrap().path()).unwrap() {
            out.insert(format!("sha256:{}", b.unwrap().file_name().to_string_lossy()));
        }
    }
    out
}

/// The layout `push DIR` packed into (one source directory: one layout).
fn push_layout(cache: &Path) -> OciLayout {
    let dir = fs::read_dir(cache.join("push-layouts")).unwrap().map(|e| e.unwrap().path()).find(|p| p.is_dir()).expect("a push layout");
    OciLayout::open(&dir).unwrap()
}

fn manifest_of(src: &dyn BlobSource, digest: &str) -> Manifest {
    let d = digest.parse().unwrap();
    Manifest::decode(&imgfmt::source::read_verified_blob(src, &d, imgfmt::manifest::MAX_MANIFEST_BYTES).unwrap()).unwrap()
}

/// Descriptors of `m`'s packs with owner `owner`.
fn packs_owned(m: &Manifest, owner: &str) -> BTreeSet<String> {
    m.layers
        .iter()
        .filter(|d| d.media_type == media::PACK && d.annotations.get(media::ANN_OWNER).is_some_and(|o| o == owner))
        .map(|d| d.digest.to_string())
        .collect()
}

/// 300 hibernations of one sandbox, each pushed as a layer over the previous tag: every
/// push succeeds (the 65th failed before: "parent chain depth is 65, over the limit of
/// 64"), the 65th and every 65th after it is rebased and uploads no pack it did not write
/// itself (only its one changed chunk, its index, config and manifest), and the last
/// layer and a rebased one pull byte for byte on a fresh cache and verify.
#[test]
fn regression_issue_13_chain_of_300_layers_pushes_and_pulls() {
    const LAYERS: usize = 300;
    let storage = tempfile::tempdir().unwrap();
    let serve = Serve::start(storage.path().to_str().unwrap(), &[], &[]);
    let work = tempfile::tempdir().unwrap();
    let snap = Snapshot::new(work.path().join("snap"));
    let cmd = || {
        let mut c = snapctl();
        c.env("SNAPCTL_CACHE", work.path().join("cache")).env("DOCKER_CONFIG", work.path().join("docker"));
        c
    };
    let tag = |i: usize| format!("{}/sandbox/vm:h{i}", serve.addr);
    let depths = expected_depths(LAYERS, LIMIT);
    let mut rebased = Vec::new();
    let mut kept = Vec::new(); // (layer, vm.mem) of the rebased layers, to pull later
    for (i, &depth) in depths.iter().enumerate() {
        if i > 0 {
            snap.mutate(i as u64);
        }
        let before = stored_blobs(storage.path());
        let mut c = cmd();
        // Compaction off: this checks what a rebase alone stores and sends (a compaction
        // stores unchanged chunks again on purpose; pusher's own test covers it).
        c.arg("push").arg(&snap.dir).arg(tag(i)).args(["--chunk-size", "64KiB", "--json", "--compact-after", "off"]);
        if i > 0 {
            c.args(["--parent", &tag(i - 1)]);
        }
        let r = run(&mut c);
        assert_eq!(r.code, 0, "push of layer {i} failed: {}", r.stderr);
        let rep = json(&r);
        // The image as pushed: a layer lists each ancestor's config.
        let manifest = manifest_of(&push_layout(&work.path().join("cache")), rep["manifest"].as_str().unwrap());
        let ancestors = manifest.layers.iter().filter(|d| d.media_type == media::CONFIG).count();
        assert_eq!(ancestors, depth, "layer {i}: ancestors listed in its manifest");
        let step = &rep["pack"];
        assert_eq!(step["chain_depth"].as_u64(), Some(depth as u64), "layer {i}: {rep}");
        let is_rebase = i > 0 && depth == 0;
        assert_eq!(step["rebased"].as_bool(), Some(is_rebase), "layer {i}: {rep}");
        if !is_rebase {
            continue;
        }
        rebased.push(i);
        kept.push((i, snap.mem()));
        assert_eq!(
            step["rebased_from"].as_str().map(String::from),
            Some(json(&ok(cmd().args(["inspect", &tag(i - 1), "--json"])))["manifest"].as_str().unwrap().to_string())
        );
        assert!(r.stderr.contains("rebased: "), "people are told: {}", r.stderr);

        // What the rebase added to the registry: its manifest, config, index and the one
        // pack of the chunk this hibernation changed. Every other pack its records point
        // into was there before, and went up with no byte sent.
        let after = stored_blobs(storage.path());
        let added: BTreeSet<String> = after.difference(&before).cloned().collect();
        let own = packs_owned(&manifest, "self");
        let chain = packs_owned(&manifest, media::OWNER_REBASED);
        assert_eq!(own.len(), 1, "layer {i}: one changed chunk, one new pack: {manifest:?}");
        assert!(!chain.is_empty(), "layer {i}: the rebased index points into the chain's packs");
        assert!(chain.is_subset(&before), "layer {i}: every chain pack was in the registry before the rebase");
        let mut want: BTreeSet<String> = own.clone();
        want.extend([rep["manifest"].as_str().unwrap().to_string(), manifest.config.digest.to_string()]);
        want.extend(manifest.layers.iter().filter(|d| d.media_type == media::INDEX).map(|d| d.digest.to_string()));
        // Its outboard: slice CVs of every raw record, taken from the chain's outboards.
        let outboard: u64 = manifest.layers.iter().filter(|d| d.media_type == media::OUTBOARD).map(|d| d.size).sum();
        want.extend(manifest.layers.iter().filter(|d| d.media_type == media::OUTBOARD).map(|d| d.digest.to_string()));
        assert_eq!(added, want, "layer {i}: the rebase stored only its own new blobs");
        let new_bytes: u64 = manifest.layers.iter().chain([&manifest.config]).filter(|d| added.contains(d.digest.as_str())).map(|d| d.size).sum();
        assert_eq!(rep["bytes_sent"].as_u64(), Some(new_bytes), "layer {i}: bytes sent = the new blobs: {rep}");
        assert!(new_bytes < (CHUNK as u64) + (16 << 10) + outboard, "layer {i}: a rebase sends about one chunk, not the image: {new_bytes}");
        assert!(manifest.annotations.contains_key(media::ANN_REBASED_FROM), "{manifest:?}");
    }
    assert_eq!(rebased, [65, 130, 195, 260], "a rebase each time the chain would pass {LIMIT} ancestors");

    // The last layer (40 ancestors since the last rebase) and the first rebased one, on a
    // fresh cache: byte for byte, and verify passes from the registry.
    kept.truncate(1);
    kept.push((LAYERS, snap.mem()));
    for (i, mem) in &kept {
        let out = work.path().join(format!("out-{i}"));
        let r = ok(cmd().arg("pull").arg(tag(*i)).arg(&out).arg("--cache").arg(work.path().join(format!("fresh-cache-{i}"))).arg("--json"));
        assert_eq!(json(&r)["cached_chunks"].as_u64(), Some(0), "{r:?}");
        assert!(fs::read(out.join("vm.mem")).unwrap() == *mem, "layer {i}: pulled vm.mem differs");
        assert_eq!(fs::read(out.join("vm.state")).unwrap(), fs::read(snap.dir.join("vm.state")).unwrap());
        ok(cmd().arg("verify").arg(tag(*i)).arg("--against").arg(&out));
    }
    drop(serve);
}

/// Issue 22 §6: the same 300 hibernations pushed with the default flags, so compaction
/// (`--compact-after 16`) is on: layers are compacted again and again (each stores the
/// unchanged chunks of the little-used packs once more; pusher's
/// `regression_issue_22_a_long_history_is_compacted_into_few_packs` checks the bound),
/// and afterwards every one of the 301 images in the registry unpacks byte for byte and
/// verifies.
#[test]
fn regression_issue_22_chain_of_300_layers_with_default_compaction_unpacks_and_verifies_every_layer() {
    const LAYERS: usize = 300;
    let storage = tempfile::tempdir().unwrap();
    let serve = Serve::start(storage.path().to_str().unwrap(), &[], &[]);
    let work = tempfile::tempdir().unwrap();
    let snap = Snapshot::new(work.path().join("snap"));
    let cmd = || {
        let mut c = snapctl();
        c.env("SNAPCTL_CACHE", work.path().join("cache")).env("DOCKER_CONFIG", work.path().join("docker"));
        c
    };
    let tag = |i: usize| format!("{}/sandbox/vm:h{i}", serve.addr);
    let mut compacted = Vec::new();
    for i in 0..=LAYERS {
        if i > 0 {
            snap.mutate(i as u64);
        }
        let mut c = cmd();
        c.arg("push").arg(&snap.dir).arg(tag(i)).args(["--chunk-size", "64KiB", "--json"]);
        if i > 0 {
            c.args(["--parent", &tag(i - 1)]);
        }
        let r = run(&mut c);
        assert_eq!(r.code, 0, "push of layer {i} failed: {}", r.stderr);
        // push --json does not carry the pack report's compaction figures; people are
        // told on stderr ("compacted: … unchanged chunks … were stored again").
        if r.stderr.contains("compacted: ") {
            compacted.push(i);
        }
    }
    assert!(compacted.len() >= 10, "compaction is on by default: compacted at {compacted:?}");

    let mut mem = Snapshot::initial_mem();
    for i in 0..=LAYERS {
        if i > 0 {
            let (at, bytes) = Snapshot::mutation(i as u64);
            mem[at as usize..at as usize + bytes.len()].copy_from_slice(&bytes);
        }
        let out = work.path().join("out");
        let _ = fs::remove_dir_all(&out);
        ok(cmd().arg("unpack").arg(tag(i)).arg(&out));
        assert!(fs::read(out.join("vm.mem")).unwrap() == mem, "layer {i}: unpacked vm.mem differs");
        ok(cmd().arg("verify").arg(tag(i)));
    }
    assert_eq!(mem, snap.mem(), "the replayed history ends where the snapshot did");
    drop(serve);
}

/// `pack --parent` into a layout, many times, with the limit lowered by `--max-chain`: a
/// rebase every N+1 layers; every layer unpacks to its snapshot's bytes and verifies, a
/// rebased image has no parent and the same content root a layer of that content has.
#[test]
fn pack_max_chain_rebases_in_a_layout() {
    const N: usize = 3;
    const LAYERS: usize = 13;
    let work = tempfile::tempdir().unwrap();
    let snap = Snapshot::new(work.path().join("snap"));
    let lay = work.path().join("layout");
    let r#ref = |i: usize| format!("oci:{}:l{i}", lay.display());
    let depths = expected_depths(LAYERS, N);
    let mut contents = Vec::new();
    for (i, &depth) in depths.iter().enumerate() {
        if i > 0 {
            snap.mutate(i as u64);
        }
        contents.push(snap.mem());
        let mut c = snapctl();
        c.arg("pack").arg(&snap.dir).arg(r#ref(i)).args(["--chunk-size", "64KiB", "--json", "--max-chain", &N.to_string()]);
        if i > 0 {
            c.args(["--parent", &r#ref(i - 1)]);
        }
        let rep = json(&ok(&mut c));
        assert_eq!(rep["chain_depth"].as_u64(), Some(depth as u64), "layer {i}: {rep}");
        assert_eq!(rep["rebased"].as_bool(), Some(i > 0 && depth == 0), "layer {i}: {rep}");
        if i > 0 && depth == 0 {
            // The same directory as a plain layer over the same parent: same content root.
            let mut plain = snapctl();
            plain.arg("pack").arg(&snap.dir).arg(format!("oci:{}:plain{i}", lay.display())).args([
                "--chunk-size",
                "64KiB",
                "--json",
                "--parent",
                &r#ref(i - 1),
            ]);
            let layer = json(&ok(&mut plain));
            assert_eq!((layer["rebased"].as_bool(), layer["chain_depth"].as_u64()), (Some(false), Some(N as u64 + 1)));
            assert_eq!(rep["root"], layer["root"], "layer {i}: rebased and plain layer name the same content");
            let layout = OciLayout::open(&lay).unwrap();
            let img = Image::open(&layout, &rep["manifest"].as_str().unwrap().parse().unwrap()).unwrap();
            assert_eq!(img.chain.len(), 1, "a rebased image has no parent");
            assert!(!img.index().layer && img.config().parent.is_none());
            assert_eq!(rep["pack_bytes"].as_u64(), Some(CHUNK as u64), "only the changed chunk is stored");
        }
    }
    for (i, mem) in contents.iter().enumerate() {
        let out = work.path().join(format!("out-{i}"));
        ok(snapctl().arg("unpack").arg(r#ref(i)).arg(&out));
        assert!(fs::read(out.join("vm.mem")).unwrap() == *mem, "layer {i}: unpacked vm.mem differs");
        ok(snapctl().arg("verify").arg(r#ref(i)).arg("--against").arg(&out));
    }
    // Out-of-range limits are refused before anything is written.
    let r = run(snapctl().arg("pack").arg(&snap.dir).arg(r#ref(99)).args(["--max-chain", "65"]));
    assert_eq!(r.code, 2, "{r:?}");
}

/// A layout read through a source that takes 30 ms per read of the blobs in `slow` and
/// records how many of those reads overlap: a registry 30 ms away, as far as those blobs
/// go (verify's outboard reads, or its pack range reads).
struct SlowReads<'a> {
    inner: &'a OciLayout,
    slow: BTreeSet<imgfmt::OciDigest>,
    now: std::sync::atomic::AtomicUsize,
    most: std::sync::atomic::AtomicUsize,
    reads: std::sync::atomic::AtomicUsize,
}

impl<'a> SlowReads<'a> {
    fn new(inner: &'a OciLayout, slow: BTreeSet<imgfmt::OciDigest>) -> Self {
        SlowReads { inner, slow, now: Default::default(), most: Default::default(), reads: Default::default() }
    }
    /// One round trip, if `digest` is a slow blob.
    fn wait(&self, digest: &imgfmt::OciDigest) {
        use std::sync::atomic::Ordering::SeqCst;
        if !self.slow.contains(digest) {
            return;
        }
        self.reads.fetch_add(1, SeqCst);
        let n = self.now.fetch_add(1, SeqCst) + 1;
        self.most.fetch_max(n, SeqCst);
        std::thread::sleep(std::time::Duration::from_millis(30));
        self.now.fetch_sub(1, SeqCst);
    }
}

impl imgfmt::source::Forward for SlowReads<'_> {
    fn inner(&self) -> &dyn BlobSource {
        self.inner
    }
    fn read_blob_unverified(&self, digest: &imgfmt::OciDigest, limit: u64) -> Result<Vec<u8>, imgfmt::FormatError> {
        self.wait(digest);
        self.inner.read_blob_unverified(digest, limit)
    }
    fn read_at_unverified(&self, digest: &imgfmt::OciDigest, offset: u64, buf: &mut [u8]) -> Result<(), imgfmt::FormatError> {
        self.wait(digest);
        self.inner.read_at_unverified(digest, offset, buf)
    }
}

/// Before, verify read one chunk per request on one thread per core: at 20 ms RTT it
/// used about 40 % of a 1 Gbit/s link (issue 16). Neighbouring chunks are now read as one
/// range, several ranges in flight; checked by counting and overlap, not by time.
#[test]
fn regression_issue_16_verify_reads_neighbouring_chunks_as_ranges_several_at_a_time() {
    let work = tempfile::tempdir().unwrap();
    let snap = Snapshot::new(work.path().join("snap"));
    let lay = work.path().join("layout");
    ok(snapctl().arg("pack").arg(&snap.dir).arg(format!("oci:{}:v1", lay.display())).args(["--chunk-size", "64KiB", "--compress", "none"]));
    let layout = OciLayout::open(&lay).unwrap();
    let image = Image::open(&layout, &layout.resolve_tag("v1").unwrap()).unwrap();
    let src = SlowReads::new(&layout, image.packs.iter().map(|p| p.digest.clone()).collect());
    let opts = verify::AuditOptions { threads: 2, max_range: 256 << 10, ..Default::default() };
    let report = verify::audit(&src, &image, &opts).unwrap();
    assert!(report.ok(), "{:?}", report.failures);
    use std::sync::atomic::Ordering::SeqCst;
    let (reads, chunks) = (src.reads.load(SeqCst) as u64, report.stored_chunks_checked);
    // Back-to-back chunks of 64 KiB in ranges of at most 256 KiB: a quarter of the
    // requests, plus one per break (a pack's end, a zero chunk between two stored ones).
    assert!(chunks >= 16 && reads * 2 <= chunks, "{reads} range reads for {chunks} stored chunks: one request per chunk");
    assert!(src.most.load(SeqCst) >= 4, "range reads overlapping at most {}: one per core", src.most.load(SeqCst));
}

/// bench/chain.sh at 20 ms RTT: verify of a 64-ancestor layer took 2.18x layer 1's, most of
/// it the ancestors' outboards read one after another, a round trip each. They are now
/// read several at a time; checked by overlap, not by time.
#[test]
fn regression_issue_13_verify_reads_a_chains_outboards_several_at_a_time() {
    const LAYERS: usize = 12;
    let work = tempfile::tempdir().unwrap();
    let snap = Snapshot::new(work.path().join("snap"));
    let lay = work.path().join("layout");
    let r#ref = |i: usize| format!("oci:{}:l{i}", lay.display());
    for i in 0..LAYERS {
        if i > 0 {
            snap.mutate(i as u64);
        }
        let mut c = snapctl();
        c.arg("pack").arg(&snap.dir).arg(r#ref(i)).args(["--chunk-size", "64KiB", "--compress", "none"]);
        if i > 0 {
            c.args(["--parent", &r#ref(i - 1)]);
        }
        ok(&mut c);
    }
    let layout = OciLayout::open(&lay).unwrap();
    let d = layout.resolve_tag(&format!("l{}", LAYERS - 1)).unwrap();
    let image = Image::open(&layout, &d).unwrap();
    let outboards: BTreeSet<_> = image.manifest.layers.iter().filter(|l| l.media_type == media::OUTBOARD).map(|l| l.digest.clone()).collect();
    assert_eq!(outboards.len(), LAYERS, "every layer has an outboard of its changed chunk");
    let src = SlowReads::new(&layout, outboards);
    let report = verify::audit(&src, &image, &verify::AuditOptions { threads: 2, blob_digests: false, ..Default::default() }).unwrap();
    assert!(report.ok(), "{:?}", report.failures);
    // Layer 0's 32 vm.mem chunks and its 2-slice vm.state, then one changed chunk a layer.
    assert_eq!(report.outboard_entries_checked as usize, MEM / CHUNK + 1 + (LAYERS - 1), "{report:?}");
    use std::sync::atomic::Ordering::SeqCst;
    assert_eq!(src.reads.load(SeqCst), LAYERS, "each outboard read once");
    assert!(src.most.load(SeqCst) >= 4, "outboard reads overlapping at most {}: one round trip each, one after another", src.most.load(SeqCst));
}
