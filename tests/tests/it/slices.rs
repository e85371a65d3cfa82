//! Fault-sized verified slices (issue 16 §2): the outboard `pack` writes, slices read one
//! pack range at a time and each verified, a tampered slice refused by name while its
//! neighbours still verify, outboard lies caught by `verify`, and images without an
//! outboard (older ones, SHA-256, `--slice-size none`) working as before.

use std::fs;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use imgfmt::outboard::Outboard;
use imgfmt::{media, BlobSource, Image, OciDigest, OciLayout, OutboardsAhead, StoredAt};
use pusher::{PackOptions, Related};
use snapctl_tests::{run, snapctl, SplitMix64};
use verify::VerifyError;

const KIB: usize = 1024;

fn random(len: usize, seed: u64) -> Vec<u8> {
    let mut r = SplitMix64(seed);
    let mut v: Vec<u8> = (0..len.div_ceil(8)).flat_map(|_| r.next_u64().to_le_bytes()).collect();
    v.truncate(len);
    v
}

/// `vm.mem`: four random 256 KiB chunks, a zero chunk, then a 10 KiB tail; plus files of
/// 4097 bytes (two slices, the second of one byte), 4096 (one slice: no entry) and text
/// that zstd would shrink (raw here: no compression).
fn write_source(dir: &Path) -> PathBuf {
    let src = dir.join("src");
    fs::create_dir_all(&src).unwrap();
    let mut mem = random(4 * 256 * KIB, 1);
    mem.extend(vec![0u8; 256 * KIB]);
    mem.extend(random(10 * KIB, 2));
    fs::write(src.join("vm.mem"), &mem).unwrap();
    fs::write(src.join("edge"), random(4097, 3)).unwrap();
    fs::write(src.join("page"), random(4096, 4)).unwrap();
    fs::write(src.join("text"), b"restore the sandbox page by page ".repeat(1000)).unwrap();
    src
}

fn pack(src: &Path, layout: &OciLayout, tag: &str, opts: &PackOptions) {
    pusher::pack(src, layout, tag, opts).unwrap_or_else(|e| panic!("pack {}: {e}", src.display()));
}

fn open_loaded(layout: &OciLayout, tag: &str) -> Image {
    let mut img = Image::open(layout, &layout.resolve_tag(tag).unwrap()).unwrap();
    img.load_outboards(layout).unwrap();
    img
}

/// Change byte `at` of the source's `vm.mem` and pack it as `child`, a layer over `parent`:
/// the new `vm.mem` and the layer's manifest.
fn pack_layer(src: &Path, layout: &OciLayout, parent: &str, at: usize) -> (Vec<u8>, OciDigest) {
    let mut mem = fs::read(src.join("vm.mem")).unwrap();
    mem[at] ^= 0xff;
    fs::write(src.join("vm.mem"), &mem).unwrap();
    let image = Image::open(layout, &layout.resolve_tag(parent).unwrap()).unwrap();
    pack(src, layout, "child", &PackOptions { parent: Some(Related { source: layout, image, reference: parent.into() }), ..opts_256k() });
    (mem, layout.resolve_tag("child").unwrap())
}

fn opts_256k() -> PackOptions<'static> {
    PackOptions { chunk_shift: 18, ..Default::default() }
}

fn blob_path(layout: &Path, d: &OciDigest) -> PathBuf {
    layout.join("blobs/sha256").join(d.hex())
}

/// The bytes of file `name` in the source, chunk `chunk` (256 KiB chunks).
fn source_chunk(src: &Path, name: &str, chunk: u64) -> Vec<u8> {
    let all = fs::read(src.join(name)).unwrap();
    let start = (chunk as usize * 256 * KIB).min(all.len());
    all[start..(start + 256 * KIB).min(all.len())].to_vec()
}

#[test]
fn every_raw_chunk_longer_than_a_slice_reads_back_slice_by_slice() {
    let dir = tempfile::tempdir().unwrap();
    let src = write_source(dir.path());
    let layout = OciLayout::open_or_create(dir.path().join("l")).unwrap();
    pack(&src, &layout, "t", &opts_256k());
    let img = open_loaded(&layout, "t");
    let outboards: Vec<_> = img.manifest.layers.iter().filter(|l| l.media_type == media::OUTBOARD).collect();
    assert_eq!(outboards.len(), 1, "one outboard, owned by the image");
    assert_eq!(outboards[0].annotations[media::ANN_OWNER], "self");
    let mut with_entry = 0;
    for (fi, f) in img.files.iter().enumerate() {
        for (ci, c) in f.chunks.iter().enumerate() {
            let ci = ci as u64;
            let raw_over_a_slice = matches!(c.at, StoredAt::Pack { codec: imgfmt::compress::Codec::Raw, .. }) && c.len > 4096;
            let Some(cvs) = img.slice_cvs(fi, ci) else {
                assert!(!raw_over_a_slice, "{} chunk {ci} ({} bytes) has no entry", f.name, c.len);
                let e = verify::read_slices(&layout, &img, fi, ci, 0..1).unwrap_err();
                assert!(matches!(e, VerifyError::NoSlices { .. }), "{e}");
                continue;
            };
            assert!(raw_over_a_slice);
            with_entry += 1;
            let want = source_chunk(&src, &f.name, ci);
            let n = cvs.slice_count();
            assert_eq!(n as usize, want.len().div_ceil(4096));
            // All slices in one range, then in runs of three: the bytes are the source's.
            let all: Vec<u8> = verify::read_slices(&layout, &img, fi, ci, 0..n).unwrap().iter().flat_map(|s| s.as_bytes().to_vec()).collect();
            assert_eq!(all, want, "{} chunk {ci}", f.name);
            let mut start = 0;
            while start < n {
                let end = (start + 3).min(n);
                for s in verify::read_slices(&layout, &img, fi, ci, start..end).unwrap() {
                    let at = s.offset_in_chunk() as usize;
                    assert_eq!(at, s.slice() as usize * 4096);
                    assert_eq!(s.as_bytes(), &want[at..(at + 4096).min(want.len())]);
                }
                start = end;
            }
            let e = verify::read_slices(&layout, &img, fi, ci, n..n + 1).unwrap_err();
            assert!(matches!(e, VerifyError::SliceRange { .. }), "{e}");
        }
    }
    // vm.mem: 4 random chunks + the 10 KiB tail; edge (4097 bytes); text (33 000 bytes).
    assert_eq!(with_entry, 7);
    assert_eq!(run(snapctl().arg("verify").arg(format!("oci:{}:t", dir.path().join("l").display()))).code, 0);
}

#[test]
fn a_tampered_slice_is_refused_by_name_and_its_neighbours_still_verify() {
    let dir = tempfile::tempdir().unwrap();
    let src = write_source(dir.path());
    let lay = dir.path().join("l");
    let layout = OciLayout::open_or_create(&lay).unwrap();
    pack(&src, &layout, "t", &opts_256k());
    let img = open_loaded(&layout, "t");
    let (fi, f) = img.file("vm.mem").unwrap();
    let StoredAt::Pack { pack, offset, .. } = f.chunks[1].at else { panic!("chunk 1 is stored") };
    // Flip one byte 100 bytes into slice 5 of chunk 1.
    let at = offset + 5 * 4096 + 100;
    let p = fs::OpenOptions::new().read(true).write(true).open(blob_path(&lay, &img.packs[pack as usize].digest)).unwrap();
    let mut b = [0u8; 1];
    p.read_exact_at(&mut b, at).unwrap();
    p.write_all_at(&[b[0] ^ 0x01], at).unwrap();

    let n = img.slice_cvs(fi, 1).unwrap().slice_count();
    assert_eq!(n, 64);
    let e = verify::read_slices(&layout, &img, fi, 1, 0..n).unwrap_err();
    let VerifyError::SliceMismatch { file, chunk, slice, offset: off, .. } = &e else { panic!("expected a slice mismatch, got {e}") };
    assert_eq!((file.as_str(), *chunk, *slice, *off), ("vm.mem", 1, 5, (256 * KIB + 5 * 4096) as u64));
    assert!(e.to_string().starts_with(&format!("vm.mem: chunk 1 slice 5 at offset {}: slice CV mismatch", 256 * KIB + 5 * 4096)), "{e}");
    assert!(verify::read_slices(&layout, &img, fi, 1, 5..6).is_err());
    // The neighbours, and every other chunk, still verify.
    let want = source_chunk(&src, "vm.mem", 1);
    for r in [0..5, 6..n] {
        for s in verify::read_slices(&layout, &img, fi, 1, r).unwrap() {
            let o = s.offset_in_chunk() as usize;
            assert_eq!(s.as_bytes(), &want[o..o + 4096]);
        }
    }
    assert_eq!(verify::read_slices(&layout, &img, fi, 0, 0..64).unwrap().len(), 64);
    // The whole chunk fails as before, and verify names it.
    assert!(matches!(verify::read_chunk(&layout, &img, fi, 1), Err(VerifyError::DigestMismatch { chunk: 1, .. })));
    let r = run(snapctl().arg("verify").arg(format!("oci:{}:t", lay.display())));
    assert_eq!(r.code, 1, "{r:?}");
    assert!(r.stderr.contains(&format!("vm.mem: chunk 1 at offset {}", 256 * KIB)), "{}", r.stderr);
}

/// Replace the image's outboard with `ob` (or drop it): the blob put under its own name,
/// the manifest rewritten and re-tagged. Every digest stays consistent: a consistent lie.
fn replace_outboard(lay: &Path, tag: &str, ob: Option<&Outboard>) {
    let layout = OciLayout::open(lay).unwrap();
    let img = Image::open(&layout, &layout.resolve_tag(tag).unwrap()).unwrap();
    let mut m = img.manifest.clone();
    let i = m.layers.iter().position(|l| l.media_type == media::OUTBOARD).expect("an outboard");
    match ob {
        Some(ob) => {
            let bytes = ob.encode();
            m.layers[i].digest = layout.put_blob(&bytes).unwrap();
            m.layers[i].size = bytes.len() as u64;
        }
        None => {
            m.layers.remove(i);
        }
    }
    let mb = m.encode();
    let d = layout.put_blob(&mb).unwrap();
    layout.set_tag(tag, imgfmt::Descriptor::new(media::OCI_MANIFEST, d, mb.len() as u64)).unwrap();
}

fn verify_json(lay: &Path, tag: &str) -> (i32, serde_json::Value, String) {
    let r = run(snapctl().args(["verify", "--json"]).arg(format!("oci:{}:{tag}", lay.display())));
    (r.code, serde_json::from_str(&r.stdout).unwrap_or_default(), r.stderr)
}

#[test]
fn outboard_lies_fail_verify_and_are_refused_before_any_slice() {
    let dir = tempfile::tempdir().unwrap();
    let src = write_source(dir.path());
    let lay = dir.path().join("l");
    let layout = OciLayout::open_or_create(&lay).unwrap();
    pack(&src, &layout, "t", &opts_256k());
    let img = open_loaded(&layout, "t");
    let (fi, f) = img.file("vm.mem").unwrap();
    let target = f.chunks[2].digest;
    let original: Outboard = (*img.chain[0].outboard.clone().unwrap()).clone();

    // 1. One CV of chunk 2's entry changed: the entry no longer merges to its digest.
    let mut lie = original.clone();
    let first = lie.entries.iter().find(|e| e.digest == target).unwrap().first_cv as usize;
    lie.cvs[first + 7][0] ^= 1;
    lie.validate().unwrap();
    replace_outboard(&lay, "t", Some(&lie));
    let (code, j, stderr) = verify_json(&lay, "t");
    assert_eq!(code, 1, "{stderr}");
    let fails = j["report"]["failures"].as_array().unwrap();
    assert_eq!(fails.len(), 1, "{fails:?}");
    assert_eq!(fails[0]["kind"], "outboard");
    assert!(fails[0]["message"].as_str().unwrap().contains(&format!("chunk {target} merge to")), "{}", fails[0]);
    let img = open_loaded(&layout, "t");
    let e = verify::read_slices(&layout, &img, fi, 2, 7..8).unwrap_err();
    assert!(matches!(e, VerifyError::OutboardMismatch { chunk: 2, .. }), "{e}");
    // Even the slices whose CVs are right: the entry as a whole is not trusted.
    assert!(matches!(verify::read_slices(&layout, &img, fi, 2, 0..1), Err(VerifyError::OutboardMismatch { .. })));
    assert_eq!(verify::read_slices(&layout, &img, fi, 3, 0..64).unwrap().len(), 64, "other entries still serve");

    // 2. Chunk 2's entry dropped: verify names the chunk that lost it.
    let without = Outboard::from_entries(
        original.chunk_shift,
        original.slice_shift,
        original.entries.iter().enumerate().filter(|(_, e)| e.digest != target).map(|(i, e)| (e.digest, e.chunk_len, original.entry(i).cvs.to_vec())).collect(),
    )
    .unwrap();
    replace_outboard(&lay, "t", Some(&without));
    let (code, j, stderr) = verify_json(&lay, "t");
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains(&format!("vm.mem: chunk 2 at offset {}: image: no outboard entry", 512 * KIB)), "{stderr}");
    assert_eq!(j["report"]["failures"][0]["kind"], "outboard");
    let img = open_loaded(&layout, "t");
    assert!(matches!(verify::read_slices(&layout, &img, fi, 2, 0..1), Err(VerifyError::NoSlices { .. })));

    // 3. A flipped byte in the outboard blob itself: its sha256 no longer matches.
    replace_outboard(&lay, "t", Some(&original));
    let img = Image::open(&layout, &layout.resolve_tag("t").unwrap()).unwrap();
    let d = img.chain[0].outboard_blob.clone().unwrap().digest;
    let p = fs::OpenOptions::new().read(true).write(true).open(blob_path(&lay, &d)).unwrap();
    let mut b = [0u8; 1];
    p.read_exact_at(&mut b, 200).unwrap();
    p.write_all_at(&[b[0] ^ 0x01], 200).unwrap();
    let (code, _, stderr) = verify_json(&lay, "t");
    assert_eq!(code, 1);
    assert!(stderr.contains(&format!("blob {d}: content hashes to")), "{stderr}");
    let mut img = img;
    assert!(img.load_outboards(&layout).is_err());

    // 4. No outboard at all: a valid image (whole-chunk reads), as before outboards existed.
    replace_outboard(&lay, "t", None);
    let (code, _, stderr) = verify_json(&lay, "t");
    assert_eq!(code, 0, "{stderr}");
    let img = open_loaded(&layout, "t");
    assert!(img.slice_cvs(fi, 2).is_none());
    assert_eq!(verify::read_chunk(&layout, &img, fi, 2).unwrap().as_bytes(), &source_chunk(&src, "vm.mem", 2)[..]);
}

#[test]
fn a_layer_lists_its_parents_outboard_and_verifies_inherited_slices() {
    let dir = tempfile::tempdir().unwrap();
    let src = write_source(dir.path());
    let layout = OciLayout::open_or_create(dir.path().join("l")).unwrap();
    pack(&src, &layout, "parent", &opts_256k());
    // The child changes chunk 1 of vm.mem; chunk 0 is inherited.
    let mut mem = fs::read(src.join("vm.mem")).unwrap();
    mem[256 * KIB + 10] ^= 0xff;
    fs::write(src.join("vm.mem"), &mem).unwrap();
    let parent = Related { source: &layout, image: Image::open(&layout, &layout.resolve_tag("parent").unwrap()).unwrap(), reference: "parent".into() };
    pack(&src, &layout, "child", &PackOptions { parent: Some(parent), ..opts_256k() });
    let img = open_loaded(&layout, "child");
    let owners: Vec<&str> = img.manifest.layers.iter().filter(|l| l.media_type == media::OUTBOARD).map(|l| l.annotations[media::ANN_OWNER].as_str()).collect();
    assert_eq!(owners, ["self", "parent"]);
    assert_eq!(img.chain[0].outboard.as_ref().unwrap().entries.len(), 1, "the layer's outboard covers only its own record");
    let (fi, f) = img.file("vm.mem").unwrap();
    assert_eq!((f.chunks[0].depth, f.chunks[1].depth), (1, 0));
    for chunk in [0, 1] {
        let got: Vec<u8> = verify::read_slices(&layout, &img, fi, chunk, 0..64).unwrap().iter().flat_map(|s| s.as_bytes().to_vec()).collect();
        assert_eq!(got, mem[chunk as usize * 256 * KIB..(chunk as usize + 1) * 256 * KIB]);
    }
    let r = run(snapctl().args(["verify", "--json"]).arg(format!("oci:{}:child", dir.path().join("l").display())));
    assert_eq!(r.code, 0, "{}", r.stderr);
    let j: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    assert_eq!(j["report"]["outboard_entries_checked"], 1 + 7, "the layer's entry and the parent's seven");
}

/// Images without an outboard read exactly as before: the spec vectors (written before
/// outboards existed), SHA-256 images, and `--slice-size none`, whose manifest is byte for
/// byte what packing wrote before.
#[test]
fn images_without_an_outboard_still_work() {
    let vectors = snapctl_tests::workspace_root().join("spec/vectors");
    for (v, tag) in [("chain", "child"), ("raw-blake3", "v1"), ("boundaries-sha256", "v1")] {
        let layout = OciLayout::open(vectors.join(v)).unwrap();
        let mut img = Image::open(&layout, &layout.resolve_tag(tag).unwrap()).unwrap();
        assert!(img.chain.iter().all(|l| l.outboard_blob.is_none()), "{v}");
        img.load_outboards(&layout).unwrap();
        for (fi, f) in img.files.iter().enumerate() {
            for ci in 0..f.chunks.len() as u64 {
                assert!(img.slice_cvs(fi, ci).is_none());
                verify::read_chunk(&layout, &img, fi, ci).unwrap();
            }
        }
        assert!(verify::audit(&layout, &img, &Default::default()).unwrap().ok(), "{v}");
    }

    let dir = tempfile::tempdir().unwrap();
    let src = write_source(dir.path());
    let layout = OciLayout::open_or_create(dir.path().join("l")).unwrap();
    pack(&src, &layout, "none", &PackOptions { slice_shift: None, ..opts_256k() });
    pack(&src, &layout, "sha", &PackOptions { hash: imgfmt::HashAlgo::Sha256, ..opts_256k() });
    for tag in ["none", "sha"] {
        let img = open_loaded(&layout, tag);
        assert!(img.manifest.layers.iter().all(|l| l.media_type != media::OUTBOARD), "{tag}");
        let (fi, _) = img.file("vm.mem").unwrap();
        assert!(matches!(verify::read_slices(&layout, &img, fi, 0, 0..1), Err(VerifyError::NoSlices { .. })));
        assert!(verify::audit(&layout, &img, &Default::default()).unwrap().ok());
    }
    // An outboard listed for a SHA-256 image is refused (only BLAKE3 is a tree).
    let sha = Image::open(&layout, &layout.resolve_tag("sha").unwrap()).unwrap();
    let mut m = sha.manifest.clone();
    let ob = Outboard::from_entries(18, 12, vec![]).unwrap().encode();
    m.layers.push(imgfmt::Descriptor::new(media::OUTBOARD, layout.put_blob(&ob).unwrap(), ob.len() as u64).with_annotation(media::ANN_OWNER, "self"));
    let e = Image::open(&layout, &layout.put_blob(&m.encode()).unwrap()).unwrap_err();
    assert!(e.to_string().contains("only BLAKE3 has slice CVs"), "{e}");
}

#[test]
fn pack_refuses_slice_sizes_it_cannot_write() {
    let dir = tempfile::tempdir().unwrap();
    let src = write_source(dir.path());
    let dest = format!("oci:{}:t", dir.path().join("l").display());
    for (args, want) in [
        (vec!["--slice-size", "2KiB"], "must be a power of two from 4KiB to half the chunk size"),
        (vec!["--slice-size", "12KiB"], "must be a power of two"),
        (vec!["--slice-size", "1MiB"], "half the chunk size (524288)"),
        (vec!["--slice-size", "64KiB", "--chunk-size", "64KiB"], "half the chunk size (32768)"),
        (vec!["--slice-size", "4KiB", "--hash", "sha256"], "--slice-size needs --hash blake3"),
        (vec!["--slice-size", "lots"], "invalid value"),
    ] {
        let r = run(snapctl().arg("pack").arg(&src).arg(&dest).args(&args));
        assert_eq!(r.code, 2, "{args:?}: {r:?}");
        assert!(r.stderr.contains(want), "{args:?}: {}", r.stderr);
    }
    let r = run(snapctl().arg("pack").arg(&src).arg(&dest).args(["--slice-size", "none", "--json"]));
    assert_eq!(r.code, 0, "{r:?}");
    assert_eq!(serde_json::from_str::<serde_json::Value>(&r.stdout).unwrap()["outboard_entries"], 0);
    let r = run(snapctl().arg("pack").arg(&src).arg(&dest).args(["--slice-size", "16KiB", "--chunk-size", "64KiB", "--json"]));
    assert_eq!(r.code, 0, "{r:?}");
    assert_eq!(serde_json::from_str::<serde_json::Value>(&r.stdout).unwrap()["slice_size"], 16384);
}

/// A layout whose blob reads (the manifest's aside) each wait until `together` of them
/// have started, or 10 s: reads made one after another would each wait out the 10 s, so
/// `max_in_flight` tells whether they were made at once.
struct Gate {
    layout: OciLayout,
    manifest: OciDigest,
    together: usize,
    state: std::sync::Mutex<(usize, usize, usize)>, // started, in flight, most in flight
    cv: std::sync::Condvar,
}

impl imgfmt::source::Forward for Gate {
    fn inner(&self) -> &dyn BlobSource {
        &self.layout
    }
    fn read_blob_unverified(&self, digest: &OciDigest, limit: u64) -> Result<Vec<u8>, imgfmt::FormatError> {
        if *digest != self.manifest {
            let mut s = self.state.lock().unwrap();
            s.0 += 1;
            s.1 += 1;
            s.2 = s.2.max(s.1);
            self.cv.notify_all();
            let (mut s, _) = self.cv.wait_timeout_while(s, std::time::Duration::from_secs(10), |s| s.0 < self.together).unwrap();
            s.1 -= 1;
        }
        self.layout.read_blob_unverified(digest, limit)
    }
}

/// Waking a restore waits for the image's config and index, and a replay also for its
/// outboard: read one after another they cost three round trips, read at once one; and
/// slices answer once the outboards are in (issue 23 §3, wake).
#[test]
fn regression_issue_23_the_outboard_is_read_with_the_config_and_index_and_attached_later() {
    let dir = tempfile::tempdir().unwrap();
    let src = write_source(dir.path());
    let layout = OciLayout::open_or_create(dir.path().join("l")).unwrap();
    pack(&src, &layout, "t", &opts_256k());
    let d = layout.resolve_tag("t").unwrap();
    let gate = Arc::new(Gate {
        layout: OciLayout::open(dir.path().join("l")).unwrap(),
        manifest: d.clone(),
        together: 3,
        state: Default::default(),
        cv: Default::default(),
    });
    let (img, pending) = Image::open_outboards_later(gate.clone(), &d, OutboardsAhead::Whole).unwrap();
    let (fi, _) = img.file("vm.mem").unwrap();
    pending.finish(&img).unwrap();
    let (started, _, most) = *gate.state.lock().unwrap();
    assert_eq!((started, most), (3, 3), "config, index and outboard, each read once and all at once");
    // The same image, slice for slice, as opening and then loading the outboards.
    let want = open_loaded(&layout, "t");
    for (fi, f) in want.files.iter().enumerate() {
        for c in 0..f.chunks.len() as u64 {
            assert_eq!(img.slice_cvs(fi, c).map(|s| s.slice_count()), want.slice_cvs(fi, c).map(|s| s.slice_count()), "{} chunk {c}", f.name);
        }
    }
    assert_eq!(img.slice_cvs(fi, 0).map(|s| s.slice_count()), Some(64), "vm.mem's chunks are served by slice");

    // A layer: its own outboard comes with its config and index, its parent's after them.
    let (mem, child) = pack_layer(&src, &layout, "t", 256 * KIB + 10);
    let (img, pending) = Image::open_outboards_later(Arc::new(OciLayout::open(dir.path().join("l")).unwrap()), &child, OutboardsAhead::Whole).unwrap();
    let (fi, _) = img.file("vm.mem").unwrap();
    assert!((0..2).all(|c| img.slice_cvs(fi, c).is_none()), "no slices before the outboards are in");
    pending.finish(&img).unwrap();
    for chunk in [0, 1] {
        let got: Vec<u8> = verify::read_slices(&layout, &img, fi, chunk, 0..64).unwrap().iter().flat_map(|s| s.as_bytes().to_vec()).collect();
        assert_eq!(got, mem[chunk as usize * 256 * KIB..(chunk as usize + 1) * 256 * KIB]);
    }
}

/// An outboard read ahead that does not match its digest does not fail the open: the
/// image stays without outboards (faults then fetch whole chunks), and the error names it.
#[test]
fn regression_issue_23_a_damaged_outboard_read_ahead_leaves_the_image_without_slices() {
    let dir = tempfile::tempdir().unwrap();
    let src = write_source(dir.path());
    let lay = dir.path().join("l");
    let layout = OciLayout::open_or_create(&lay).unwrap();
    pack(&src, &layout, "t", &opts_256k());
    let d = layout.resolve_tag("t").unwrap();
    let img = Image::open(&layout, &d).unwrap();
    let ob = img.chain[0].outboard_blob.clone().expect("an outboard");
    let p = blob_path(&lay, &ob.digest);
    let mut b = fs::read(&p).unwrap();
    let last = b.len() - 1;
    b[last] ^= 1;
    fs::write(&p, &b).unwrap();
    let (img, pending) = Image::open_outboards_later(Arc::new(layout), &d, OutboardsAhead::Whole).unwrap();
    let e = pending.finish(&img).unwrap_err();
    assert!(e.to_string().contains(&ob.digest.to_string()), "{e}");
    assert!(img.files.iter().enumerate().all(|(fi, f)| (0..f.chunks.len() as u64).all(|c| img.slice_cvs(fi, c).is_none())));
}

/// A source over a layout that logs each read (`None`: a whole blob; else the range) and,
/// with `flip`, changes the first byte of every range read of an outboard from past its
/// start (a chunk's CVs).
struct Logged {
    layout: OciLayout,
    outboards: Vec<OciDigest>,
    flip: bool,
    reads: std::sync::Mutex<Vec<Read>>,
}

/// A blob read: its digest and range (`None`: the whole blob).
type Read = (OciDigest, Option<(u64, usize)>);

impl imgfmt::source::Forward for Logged {
    fn inner(&self) -> &dyn BlobSource {
        &self.layout
    }
    fn read_blob_unverified(&self, digest: &OciDigest, limit: u64) -> Result<Vec<u8>, imgfmt::FormatError> {
        self.reads.lock().unwrap().push((digest.clone(), None));
        self.layout.read_blob_unverified(digest, limit)
    }
    fn read_at_unverified(&self, digest: &OciDigest, offset: u64, buf: &mut [u8]) -> Result<(), imgfmt::FormatError> {
        self.reads.lock().unwrap().push((digest.clone(), Some((offset, buf.len()))));
        self.layout.read_at_unverified(digest, offset, buf)?;
        if self.flip && offset > 0 && self.outboards.contains(digest) {
            buf[0] ^= 1;
        }
        Ok(())
    }
}

/// A restore that only serves faults opens the image with its outboards' entries alone
/// (no whole outboard is read, a layer's and its parent's alike), and a chunk's first
/// slice read brings that chunk's CVs beside it, one range of 64 CVs; the slices are the
/// source's. CVs changed on the way are caught before a byte is handed out (issue 23 §3,
/// wake: the whole outboards' bytes no longer sit in front of the first fault's).
#[test]
fn regression_issue_23_a_fault_reads_its_chunks_cvs_beside_its_slice_and_no_whole_outboard() {
    let dir = tempfile::tempdir().unwrap();
    let src = write_source(dir.path());
    let lay = dir.path().join("l");
    let layout = OciLayout::open_or_create(&lay).unwrap();
    pack(&src, &layout, "t", &opts_256k());
    let (mem, child) = pack_layer(&src, &layout, "t", 10);
    let outboards: Vec<OciDigest> =
        Image::open(&layout, &child).unwrap().chain.iter().filter_map(|l| l.outboard_blob.as_ref().map(|o| o.digest.clone())).collect();
    assert_eq!(outboards.len(), 2, "the layer's outboard and its parent's");
    let logged = |flip| Arc::new(Logged { layout: OciLayout::open(&lay).unwrap(), outboards: outboards.clone(), flip, reads: Default::default() });

    let source = logged(false);
    let (img, pending) = Image::open_outboards_later(source.clone(), &child, OutboardsAhead::Tables).unwrap();
    drop(pending);
    assert!(img.slices_on_demand());
    let (fi, _) = img.file("vm.mem").unwrap();
    // Chunk 0 is the layer's own (changed), chunk 1 its parent's.
    assert_eq!(img.files[fi].chunks[0].depth, 0);
    assert_eq!(img.files[fi].chunks[1].depth, 1);
    for chunk in [0u64, 1] {
        assert!(img.slice_cvs(fi, chunk).is_none(), "no CVs before a slice of the chunk is read");
        assert_eq!(img.slice_shape(fi, chunk).map(|s| s.slice_count()), Some(64));
        let before = source.reads.lock().unwrap().len();
        let got: Vec<u8> = verify::read_slices(source.as_ref(), &img, fi, chunk, 3..5).unwrap().iter().flat_map(|s| s.as_bytes().to_vec()).collect();
        let at = chunk as usize * 256 * KIB;
        assert_eq!(got, mem[at + 3 * 4096..at + 5 * 4096]);
        let cv_reads: Vec<_> = source.reads.lock().unwrap()[before..].iter().filter(|(d, _)| outboards.contains(d)).cloned().collect();
        assert_eq!(cv_reads.len(), 1, "one read of the chunk's CVs: {cv_reads:?}");
        assert_eq!(cv_reads[0].1.map(|r| r.1), Some(64 * 32));
        assert!(img.slice_cvs(fi, chunk).is_some(), "the CVs stay for the next fault");
        // The next slice read of the chunk reads no CVs.
        let before = source.reads.lock().unwrap().len();
        verify::read_slices(source.as_ref(), &img, fi, chunk, 9..10).unwrap();
        assert!(source.reads.lock().unwrap()[before..].iter().all(|(d, _)| !outboards.contains(d)));
    }
    let reads = source.reads.lock().unwrap();
    assert!(reads.iter().all(|(d, r)| !outboards.contains(d) || r.is_some()), "no whole outboard was read: {reads:?}");

    let source = logged(true);
    let (img, _) = Image::open_outboards_later(source.clone(), &child, OutboardsAhead::Tables).unwrap();
    for chunk in [0u64, 1] {
        let e = verify::read_slices(source.as_ref(), &img, fi, chunk, 3..5).unwrap_err();
        assert!(matches!(e, VerifyError::OutboardMismatch { .. }), "{e}");
    }
}
