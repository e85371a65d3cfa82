//! A clone packed with `--base` stores its changed chunks as their difference from the
//! base's chunk at the same position (`zstd-ref`, spec/format.md §7): what it costs the
//! store, and every reader (verify, unpack, pull with and without a cache, lazy's
//! `read_chunk`) rebuilding the exact bytes, or failing closed when the reference or the
//! difference is damaged.

use std::fs;
use std::path::{Path, PathBuf};

use snapctl_tests::registry_support::Serve;
use snapctl_tests::{run, snapctl, Run, SplitMix64};

fn ok(r: &Run) {
    assert_eq!(r.code, 0, "{r:?}");
}

fn noise(n: usize, seed: u64) -> Vec<u8> {
    let mut g = SplitMix64(seed);
    let mut v = Vec::with_capacity(n + 8);
    while v.len() < n {
        v.extend_from_slice(&g.next_u64().to_le_bytes());
    }
    v.truncate(n);
    v
}

/// A base (`vm.mem`: 4 MiB of noise, `vm.state`: 300 KB of noise) and a clone of it that
/// ran a little: 60 bytes of one page of vm.mem's chunk 2 rewritten, and 11 bytes inserted
/// near the start of vm.state (every later byte shifted, the file 11 bytes longer).
struct Fleet {
    work: tempfile::TempDir,
    base: PathBuf,
    clone: PathBuf,
    layout: PathBuf,
}

impl Fleet {
    fn new() -> Fleet {
        let work = tempfile::tempdir().unwrap();
        let (base, clone, layout) = (work.path().join("base"), work.path().join("clone"), work.path().join("layout"));
        fs::create_dir(&base).unwrap();
        fs::create_dir(&clone).unwrap();
        let mem = noise(4 << 20, 1);
        let state = noise(300_000, 2);
        fs::write(base.join("vm.mem"), &mem).unwrap();
        fs::write(base.join("vm.state"), &state).unwrap();
        let mut mem2 = mem;
        mem2[(2 << 20) + 8192..(2 << 20) + 8252].copy_from_slice(&noise(60, 3));
        let mut state2 = state;
        state2.splice(49..49, *b"eleven more");
        fs::write(clone.join("vm.mem"), &mem2).unwrap();
        fs::write(clone.join("vm.state"), &state2).unwrap();
        // One chunk per pack: the base's chunk 2 is alone in its pack, which the clone
        // then reads only as the reference of its own chunk 2.
        ok(&run(snapctl().arg("pack").arg(&base).arg(format!("oci:{}:base", layout.display())).args(["--pack-size", "1MiB"])));
        Fleet { work, base, clone, layout }
    }

    fn tag(&self, t: &str) -> String {
        format!("oci:{}:{t}", self.layout.display())
    }

    /// Pack the clone as `tag` over the base with `extra` flags; its `--json` report.
    fn pack_clone(&self, tag: &str, extra: &[&str]) -> serde_json::Value {
        let r = run(snapctl().arg("pack").arg(&self.clone).arg(self.tag(tag)).args(["--base", &self.tag("base"), "--json"]).args(extra));
        ok(&r);
        serde_json::from_str(&r.stdout).unwrap()
    }

    fn assert_restored(&self, dir: &Path) {
        for f in ["vm.mem", "vm.state"] {
            assert!(fs::read(dir.join(f)).unwrap() == fs::read(self.clone.join(f)).unwrap(), "{f} differs from the clone's");
        }
    }
}

fn n(j: &serde_json::Value, k: &str) -> u64 {
    j[k].as_u64().unwrap_or_else(|| panic!("{k} missing in {j}"))
}

#[test]
fn regression_issue_22_a_clone_stores_what_differs_from_its_base() {
    let fx = Fleet::new();
    // Before zstd-ref (and with it turned off): the two changed chunks stored whole.
    let off = fx.pack_clone("whole", &["--base-delta", "off"]);
    assert_eq!(n(&off, "base_delta_chunks"), 0);
    assert!(n(&off, "pack_bytes") > 1 << 20, "{off}");
    // With the defaults: both stored as their difference, a few KB.
    let j = fx.pack_clone("clone", &[]);
    assert_eq!((n(&j, "stored_chunks"), n(&j, "base_delta_chunks")), (2, 2), "{j}");
    assert_eq!(n(&j, "base_delta_bytes"), n(&j, "pack_bytes"));
    assert!(n(&j, "pack_bytes") < 8 << 10, "a clone's difference costs {} bytes", n(&j, "pack_bytes"));
    // The slice CVs of the base's chunks it shares stay in the base's outboard, which its
    // manifest lists: a clone carries no copy of them (3 chunks' worth before).
    assert_eq!(n(&j, "outboard_entries"), 0, "{j}");
    use imgfmt::BlobSource;
    let layout = imgfmt::OciLayout::open(&fx.layout).unwrap();
    let clone = imgfmt::Image::open(&layout, &layout.resolve_tag("clone").unwrap()).unwrap();
    let base = imgfmt::Image::open(&layout, &layout.resolve_tag("base").unwrap()).unwrap();
    assert_eq!(clone.base_outboard_blob.as_ref().map(|d| &d.digest), base.chain[0].outboard_blob.as_ref().map(|d| &d.digest));

    // Every reader gets the clone's exact bytes.
    ok(&run(snapctl().args(["verify", &fx.tag("clone")])));
    let out = fx.work.path().join("unpacked");
    ok(&run(snapctl().args(["unpack", &fx.tag("clone")]).arg(&out)));
    fx.assert_restored(&out);
    let _ = &fx.base;

    // Through a registry: the clone's manifest lists the base pack its references are in,
    // so a copy carries it; a pull with a cache that holds the base takes the references
    // from there, one without fetches them.
    let storage = tempfile::tempdir().unwrap();
    let serve = Serve::start(storage.path().to_str().unwrap(), &[], &[]);
    for t in ["base", "clone"] {
        ok(&run(snapctl().args(["copy", &fx.tag(t), &format!("{}/fleet/vm:{t}", serve.addr)])));
    }
    ok(&run(snapctl().args(["verify", &format!("{}/fleet/vm:clone", serve.addr)])));
    let cache = fx.work.path().join("cache");
    let pull = |tag: &str, dest: &Path, cache: Option<&Path>| {
        let mut c = snapctl();
        c.args(["pull", &format!("{}/fleet/vm:{tag}", serve.addr)]).arg(dest).arg("--json");
        match cache {
            Some(d) => c.arg("--cache").arg(d),
            None => c.arg("--no-cache"),
        };
        let r = run(&mut c);
        ok(&r);
        serde_json::from_str::<serde_json::Value>(&r.stdout).unwrap()
    };
    pull("base", &fx.work.path().join("pulled-base"), Some(&cache));
    pull("clone", &fx.work.path().join("pulled-cached"), Some(&cache));
    fx.assert_restored(&fx.work.path().join("pulled-cached"));
    pull("clone", &fx.work.path().join("pulled-nocache"), None);
    fx.assert_restored(&fx.work.path().join("pulled-nocache"));
}

/// Flip a bit of the stored bytes at `offset` of pack `pack` of the layout.
fn flip(layout: &Path, pack: &imgfmt::OciDigest, offset: u64) {
    use std::os::unix::fs::FileExt;
    let blob = layout.join("blobs/sha256").join(pack.to_string().trim_start_matches("sha256:"));
    let f = fs::OpenOptions::new().read(true).write(true).open(blob).unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, offset).unwrap();
    f.write_all_at(&[b[0] ^ 0x40], offset).unwrap();
}

#[test]
fn regression_issue_22_a_damaged_reference_or_difference_fails_closed() {
    use imgfmt::BlobSource;
    for damage in ["reference", "difference"] {
        let fx = Fleet::new();
        fx.pack_clone("clone", &[]);
        let layout = imgfmt::OciLayout::open(&fx.layout).unwrap();
        let image = imgfmt::Image::open(&layout, &layout.resolve_tag("clone").unwrap()).unwrap();
        let (fi, f) = image.file("vm.mem").unwrap();
        let imgfmt::StoredAt::Pack { pack, offset, stored_len, codec } = f.chunks[2].at else { panic!("chunk 2 is stored") };
        let rp = codec.ref_pack().expect("chunk 2 is stored against the base's");
        let mut stored = vec![0u8; stored_len as usize];
        layout.read_at_unverified(&image.packs[pack as usize].digest, offset, &mut stored).unwrap();
        let h = verify::ref_header(&stored).unwrap();
        match damage {
            // The base's chunk 2, which the base's own readers would also refuse.
            "reference" => flip(&fx.layout, &image.packs[rp as usize].digest, h.offset + 1000),
            // The frame after the header.
            _ => flip(&fx.layout, &image.packs[pack as usize].digest, offset + stored_len as u64 - 3),
        }
        assert!(verify::read_chunk(&layout, &image, fi, 2).is_err(), "{damage}: read_chunk handed out a chunk");
        let r = run(snapctl().args(["verify", &fx.tag("clone")]));
        assert_eq!(r.code, 1, "{damage}: {r:?}");
        assert!(r.stderr.contains("vm.mem") && r.stderr.contains("chunk 2"), "{damage}: the failure names the clone's chunk: {}", r.stderr);
        let out = fx.work.path().join("unpacked");
        let r = run(snapctl().args(["unpack", &fx.tag("clone")]).arg(&out));
        assert_ne!(r.code, 0, "{damage}: {r:?}");
        assert!(!out.join("vm.mem").exists(), "{damage}: a failed unpack left vm.mem");
    }
}

#[test]
fn regression_issue_22_a_layer_over_a_clone_keeps_its_references() {
    // A layer over the clone inherits its zstd-ref chunks; rebased (--max-chain 0), it
    // records them. Either way its manifest lists the base pack they read (an image the
    // registry keeps whole), and it verifies and unpacks to the same bytes.
    let fx = Fleet::new();
    fx.pack_clone("clone", &[]);
    // The layer changes nothing the clone changed: its own chunks are new content.
    let mut mem = fs::read(fx.clone.join("vm.mem")).unwrap();
    mem[100..200].copy_from_slice(&noise(100, 9));
    fs::write(fx.clone.join("vm.mem"), &mem).unwrap();
    for (tag, extra) in [("layer", vec![]), ("rebased", vec!["--max-chain", "0"])] {
        let r = run(snapctl().arg("pack").arg(&fx.clone).arg(fx.tag(tag)).args(["--parent", &fx.tag("clone"), "--json"]).args(&extra));
        ok(&r);
        ok(&run(snapctl().args(["verify", &fx.tag(tag)])));
        let out = fx.work.path().join(format!("out-{tag}"));
        ok(&run(snapctl().args(["unpack", &fx.tag(tag)]).arg(&out)));
        fx.assert_restored(&out);
    }
}

#[test]
fn regression_issue_22_a_clone_lazy_restores_from_its_differences() {
    use crate::lazy::{assert_clean, fake_vmm, lazy_available, n, Handler};
    if !snapctl_tests::uffd_usable() || !lazy_available() {
        return;
    }
    // The guest's memory is vm.mem; every page the runtime touches is checked against the
    // clone's file, chunk 2 (stored against the base's) among them.
    let fx = Fleet::new();
    fx.pack_clone("clone", &[]);
    let sock = fx.work.path().join("lazy.sock");
    // A cache of its own: the host's would hold these chunks from an earlier run.
    let cache = fx.work.path().join("lazy-cache");
    let mut h = Handler::lazy(&fx.tag("clone"), &sock, &["--once", "--prefetch", "none", "--cache", cache.to_str().unwrap()]);
    let r = fake_vmm(&sock, &fx.clone.join("vm.mem"), &["--threads", "2", "--seed", "3"]);
    assert_clean(&r, (4 << 20) / 4096);
    assert_eq!(h.wait_exit(std::time::Duration::from_secs(30)), 0, "{}", h.log_text());
    let rep = &h.reports(1, std::time::Duration::from_secs(1))[0];
    assert_eq!(n(rep, &["verify_failures"]), 0, "{rep}");
    // The base's chunks were served by verified slices, their CVs from the base's outboard.
    assert!(n(rep, &["slice_bytes"]) > 0, "{rep}");
}

/// A layer over a clone that rewrote the clone's `zstd-ref` chunk (vm.mem chunk 2): that
/// chunk is the clone's alone now, but its difference still sits in a pack the layer uses
/// (beside the clone's other difference, vm.state chunk 0), and its reference is a base
/// pack the layer does not list. The audit of the clone (an ancestor) finds that reference
/// in the clone's own pack table, not in the layer's: verify exits 0, as unpack agrees. A
/// damaged difference of the replaced chunk is still found and named; and where the
/// reference pack is not in the store at all (the layer copied alone), there is nothing
/// of the layer's to check there, and verify still exits 0.
#[test]
fn regression_issue_35_a_layer_rewriting_a_clones_delta_chunk_verifies() {
    use imgfmt::BlobSource;
    let fx = Fleet::new();
    fx.pack_clone("clone", &[]);
    let mut mem = fs::read(fx.clone.join("vm.mem")).unwrap();
    mem[2 << 20..3 << 20].copy_from_slice(&noise(1 << 20, 11));
    fs::write(fx.clone.join("vm.mem"), &mem).unwrap();
    ok(&run(snapctl().arg("pack").arg(&fx.clone).arg(fx.tag("layer")).args(["--parent", &fx.tag("clone")])));

    // The chain is the one described: the clone's chunk 2 is a zstd-ref in a pack the
    // layer lists, against a base pack the layer does not list.
    let layout = imgfmt::OciLayout::open(&fx.layout).unwrap();
    let clone = imgfmt::Image::open(&layout, &layout.resolve_tag("clone").unwrap()).unwrap();
    let layer = imgfmt::Image::open(&layout, &layout.resolve_tag("layer").unwrap()).unwrap();
    let imgfmt::StoredAt::Pack { pack, offset, stored_len, codec } = clone.file("vm.mem").unwrap().1.chunks[2].at else { panic!("chunk 2 is stored") };
    let (delta_pack, ref_pack) = (&clone.packs[pack as usize].digest, &clone.packs[codec.ref_pack().expect("a zstd-ref chunk") as usize].digest);
    assert!(layer.pack_index(delta_pack).is_some(), "the layer still uses the clone's delta pack");
    assert!(layer.pack_index(ref_pack).is_none(), "the layer does not list the replaced chunk's reference pack");
    assert_ne!(layer.file("vm.mem").unwrap().1.chunks[2].digest, clone.file("vm.mem").unwrap().1.chunks[2].digest);

    let r = run(snapctl().args(["verify", &fx.tag("layer")]));
    assert_eq!(r.code, 0, "a valid layer over a clone is reported corrupt: {r:?}");
    let out = fx.work.path().join("out-layer");
    ok(&run(snapctl().args(["unpack", &fx.tag("layer")]).arg(&out)));
    fx.assert_restored(&out);

    // The layer alone in a registry (its manifest's blobs, not the base's chunk-2 pack).
    let storage = tempfile::tempdir().unwrap();
    let serve = Serve::start(storage.path().to_str().unwrap(), &[], &[]);
    let remote = format!("{}/fleet/vm:layer", serve.addr);
    ok(&run(snapctl().args(["copy", &fx.tag("layer"), &remote])));
    let client = regclient::RegistrySource::new(&serve.addr, "fleet/vm", true, None).unwrap();
    assert!(client.blob_size(ref_pack).is_err(), "the registry has the replaced chunk's reference pack: the case is not tested");
    let r = run(snapctl().args(["verify", &remote]));
    assert_eq!(r.code, 0, "{r:?}");

    // The replaced chunk's difference damaged: found, naming the clone's file and chunk.
    flip(&fx.layout, delta_pack, offset + stored_len as u64 - 3);
    let r = run(snapctl().args(["verify", &fx.tag("layer")]));
    assert_eq!(r.code, 1, "{r:?}");
    assert!(r.stderr.contains("vm.mem: chunk 2 at offset 2097152"), "the failure names the chunk: {}", r.stderr);
    ok(&run(snapctl().args(["unpack", &fx.tag("layer")]).arg(fx.work.path().join("out-damaged"))));
}
