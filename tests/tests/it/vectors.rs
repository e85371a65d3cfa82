//! The spec test vectors (`spec/vectors/`, described in `spec/format.md`, "Test vectors").
//!
//! For every vector image: its inputs are regenerated from their description and its roots
//! recomputed with the library alone (chunk digests → file trees → image tree), the inputs
//! are packed again and must give the same roots (and, uncompressed, the same manifest
//! digest), and the committed layout must open and audit clean. Then every corruption
//! point is applied to a copy (one bit flipped) and `snapctl verify` must exit 1 naming
//! the blob, or the file, chunk and offset whose bytes changed. Every "consistent lie"
//! (all digests re-computed to match tampered content) must open, and still fail verify.

use std::collections::BTreeSet;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use imgfmt::index::chunk_len;
use imgfmt::{resolve_chain, BlobSource, ChunkDigest, HashAlgo, Image, OciDigest, OciLayout, StoredAt};
use serde_json::Value;
use snapctl_tests::{run, snapctl, workspace_root};

fn vectors_dir() -> PathBuf {
    workspace_root().join("spec/vectors")
}

fn vectors() -> Value {
    let p = vectors_dir().join("vectors.json");
    let text = fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e} (run spec/vectors/generate.sh)", p.display()));
    serde_json::from_str(&text).expect("vectors.json parses")
}

fn s(v: &Value) -> &str {
    v.as_str().unwrap_or_else(|| panic!("expected a string, got {v}"))
}
fn n(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("expected a number, got {v}"))
}

/// The first `len` bytes of the lines `"{tag} 00000001\n"`, `"{tag} 00000002\n"`, …
fn text(tag: &str, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len + 32);
    let mut i = 1u64;
    while out.len() < len {
        out.extend_from_slice(format!("{tag} {i:08}\n").as_bytes());
        i += 1;
    }
    out.truncate(len);
    out
}

/// A file's content from its parts.
fn content(parts: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    for p in parts.as_array().expect("parts") {
        match p.get("zero") {
            Some(z) => out.resize(out.len() + n(z) as usize, 0),
            None => out.extend(text(s(&p["text"]), n(&p["len"]) as usize)),
        }
    }
    out
}

/// Write an image's inputs under `dir` (mode 0644, as generate.sh does).
fn make_inputs(inputs: &Value, dir: &Path) {
    for f in inputs.as_array().expect("inputs") {
        let path = dir.join(s(&f["name"]));
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(&path, content(&f["parts"])).unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).unwrap();
    }
}

fn open(layout: &Path, tag: &str) -> (OciLayout, Image) {
    let l = OciLayout::open(layout).unwrap_or_else(|e| panic!("{}: {e}", layout.display()));
    let d = l.resolve_tag(tag).unwrap_or_else(|e| panic!("{}:{tag}: {e}", layout.display()));
    let img = Image::open(&l, &d).unwrap_or_else(|e| panic!("{}:{tag}: {e}", layout.display()));
    (l, img)
}

fn copy_dir(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for e in fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dest = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &dest);
        } else {
            fs::copy(e.path(), &dest).unwrap();
        }
    }
}

fn blob_path(layout: &Path, digest: &str) -> PathBuf {
    layout.join("blobs/sha256").join(digest.strip_prefix("sha256:").expect("sha256 digest"))
}

/// Roots recomputed from the inputs alone: no packer, no index.
fn check_roots_from_inputs(ctx: &str, algo: HashAlgo, chunk_size: u64, img: &Value) {
    let shift = chunk_size.trailing_zeros() as u8;
    let mut inputs: Vec<&Value> = img["inputs"].as_array().unwrap().iter().collect();
    inputs.sort_by(|a, b| s(&a["name"]).as_bytes().cmp(s(&b["name"]).as_bytes()));
    let expected = img["expected"]["files"].as_array().unwrap();
    assert_eq!(inputs.len(), expected.len(), "{ctx}: file count");
    let mut leaves = Vec::new();
    for (f, want) in inputs.iter().zip(expected) {
        let name = s(&f["name"]);
        assert_eq!(name, s(&want["name"]), "{ctx}: files are in bytewise name order");
        let data = content(&f["parts"]);
        assert_eq!(data.len() as u64, n(&want["size"]), "{ctx}: {name}: size");
        let digests: Vec<ChunkDigest> = data.chunks(chunk_size as usize).map(|c| verify::chunk_digest(algo, c)).collect();
        assert_eq!(digests.len() as u64, n(&want["chunks"]), "{ctx}: {name}: chunk count");
        for (c, chunk) in data.chunks(chunk_size as usize).enumerate() {
            assert_eq!(chunk.len() as u64, chunk_len(data.len() as u64, shift, c as u64));
        }
        let root = verify::file_root(algo, &digests);
        assert_eq!(root.display_with(algo), s(&want["root"]), "{ctx}: {name}: file root");
        leaves.push((name, data.len() as u64, root));
    }
    let root = verify::image_root(algo, leaves.iter().map(|(n, sz, r)| (*n, *sz, *r)));
    assert_eq!(root.display_with(algo), s(&img["expected"]["root"]), "{ctx}: content root");
}

/// Every (file, chunk, file offset) whose stored bytes cover `offset` of pack `pack`, in
/// the image, its ancestors and its base: the places verify may name for a flipped byte.
fn chunks_covering(layout: &OciLayout, img: &Image, pack: &OciDigest, offset: u64) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut images = vec![img.clone()];
    if let Some(b) = &img.config().base {
        images.push(Image::open(layout, &b.manifest).expect("base opens"));
    }
    for im in &images {
        let shift = im.chunk_shift();
        for k in 0..im.chain.len() {
            let (files, packs) = resolve_chain(&im.chain[k..]).expect("resolves");
            for f in &files {
                for (ci, c) in f.chunks.iter().enumerate() {
                    if let StoredAt::Pack { pack: p, offset: at, stored_len, .. } = c.at {
                        if &packs[p as usize].digest == pack && (at..at + stored_len as u64).contains(&offset) {
                            out.insert(format!("{}: chunk {ci} at offset {}", f.name, (ci as u64) << shift));
                        }
                    }
                }
            }
        }
    }
    out
}

#[test]
fn vectors_regenerate_and_audit_clean() {
    let all = vectors();
    let vdir = vectors_dir();
    for v in all["vectors"].as_array().expect("vectors") {
        let name = s(&v["name"]);
        let algo: HashAlgo = s(&v["hash"]).parse().unwrap();
        let chunk_size = n(&v["chunk_size"]);
        let tmp = tempfile::tempdir().unwrap();
        for img in v["images"].as_array().unwrap() {
            let tag = s(&img["tag"]);
            let ctx = format!("{name}:{tag}");
            check_roots_from_inputs(&ctx, algo, chunk_size, img);

            // The committed layout: opens, names what vectors.json says, audits clean.
            let (layout, opened) = open(&vdir.join(s(&v["layout"])), tag);
            let exp = &img["expected"];
            assert_eq!(opened.manifest_digest.as_str(), s(&exp["manifest"]), "{ctx}: manifest digest");
            assert_eq!(opened.chain[0].config_digest.as_str(), s(&exp["config"]), "{ctx}: config digest");
            assert_eq!(opened.chain[0].index_digest.as_str(), s(&exp["index"]), "{ctx}: index digest");
            assert_eq!(opened.config().root, s(&exp["root"]), "{ctx}: config root");
            let report = verify::audit(&layout, &opened, &verify::AuditOptions { threads: 2, blob_digests: true, ..Default::default() }).unwrap();
            assert!(report.ok(), "{ctx}: committed layout fails its audit: {:?}", report.failures);

            // Pack the inputs again, into a layout of the same name (parent and base
            // references are recorded as written: oci:<layout>:<tag>).
            let src = tmp.path().join(format!("src-{tag}"));
            make_inputs(&img["inputs"], &src);
            let mut cmd = snapctl();
            cmd.current_dir(tmp.path()).env("SOURCE_DATE_EPOCH", "0").arg("pack").arg(&src).arg(format!("oci:{}:{tag}", s(&v["layout"])));
            cmd.args(["--kind", "dir", "--chunk-size", &chunk_size.to_string(), "--hash", s(&v["hash"]), "--compress", s(&v["compression"])]);
            for rel in ["parent", "base"] {
                if let Some(t) = img[rel].as_str() {
                    cmd.arg(format!("--{rel}")).arg(format!("oci:{}:{t}", s(&v["layout"])));
                }
            }
            if let Some(m) = img["max_chain"].as_u64() {
                cmd.args(["--max-chain", &m.to_string()]);
            }
            let r = run(&mut cmd);
            assert_eq!(r.code, 0, "{ctx}: pack failed: {}", r.stderr);
            let (_, repacked) = open(&tmp.path().join(s(&v["layout"])), tag);
            assert_eq!(repacked.config().root, s(&exp["root"]), "{ctx}: repacked content root");
            for (f, want) in repacked.config().files.iter().zip(exp["files"].as_array().unwrap()) {
                assert_eq!(f.root, s(&want["root"]), "{ctx}: repacked {} root", f.name);
                assert_eq!(u64::from(f.mode), n(&want["mode"]), "{ctx}: repacked {} mode", f.name);
            }
            // Without compression every byte is determined by the format; with it, pack
            // digests depend on the compressor's output, which the format does not fix.
            if s(&v["compression"]) == "none" {
                assert_eq!(r.stdout.trim(), s(&exp["manifest"]), "{ctx}: repacked manifest digest");
            }

            let r = run(snapctl().arg("verify").arg(format!("oci:{}:{tag}", vdir.join(s(&v["layout"])).display())));
            assert_eq!(r.code, 0, "{ctx}: verify of the committed layout: {}", r.stderr);

            // A rebased image (its --parent's chain already had --max-chain ancestors):
            // no parent, a full index, the parent named only as provenance.
            if let (Some(max), Some(parent)) = (img["max_chain"].as_u64(), img["parent"].as_str()) {
                let (_, p) = open(&vdir.join(s(&v["layout"])), parent);
                if p.chain.len() as u64 > max {
                    for im in [&opened, &repacked] {
                        assert!(im.chain.len() == 1 && !im.index().layer && im.config().parent.is_none(), "{ctx}: rebased, so no parent");
                        assert_eq!(im.manifest.annotations.get(imgfmt::media::ANN_REBASED_FROM).map(String::as_str), Some(p.manifest_digest.as_str()), "{ctx}");
                    }
                }
            }
        }
        // Same inputs, same content root, however each image was packed (layer, rebased).
        let images = v["images"].as_array().unwrap();
        for a in images {
            for b in images.iter().filter(|b| b["inputs"] == a["inputs"]) {
                assert_eq!(b["expected"]["root"], a["expected"]["root"], "{name}: {} and {} hold the same files", a["tag"], b["tag"]);
            }
        }
    }
}

#[test]
fn vector_corruptions_are_each_caught() {
    let all = vectors();
    let vdir = vectors_dir();
    let mut checked = 0;
    for v in all["vectors"].as_array().expect("vectors") {
        let pristine = vdir.join(s(&v["layout"]));
        for img in v["images"].as_array().unwrap() {
            let tag = s(&img["tag"]);
            let (layout, opened) = open(&pristine, tag);
            let corruptions = img["corruptions"].as_array().unwrap();
            let regions: BTreeSet<&str> = corruptions.iter().map(|c| s(&c["blob"])).collect();
            for want in ["manifest", "config", "index", "pack"] {
                assert!(regions.contains(want), "{}:{tag}: no corruption point in a {want} blob", s(&v["name"]));
            }
            for c in corruptions {
                let (kind, digest, offset) = (s(&c["blob"]), s(&c["digest"]), n(&c["offset"]));
                let ctx = format!("{}:{tag}: {} ({kind} {digest} at {offset})", s(&v["name"]), s(&c["region"]));
                let tmp = tempfile::tempdir().unwrap();
                let copy = tmp.path().join("layout");
                copy_dir(&pristine, &copy);
                let p = blob_path(&copy, digest);
                let mut bytes = fs::read(&p).unwrap();
                bytes[offset as usize] ^= 0x01;
                fs::write(&p, &bytes).unwrap();

                let r = run(snapctl().arg("verify").arg(format!("oci:{}:{tag}", copy.display())));
                assert_eq!(r.code, 1, "{ctx}: verify must exit 1\nstdout: {}\nstderr: {}", r.stdout, r.stderr);
                assert!(r.stderr.contains(digest), "{ctx}: stderr does not name the blob: {}", r.stderr);
                if kind == "pack" {
                    let candidates = chunks_covering(&layout, &opened, &digest.parse().unwrap(), offset);
                    assert!(!candidates.is_empty(), "{ctx}: no chunk covers this byte");
                    assert!(candidates.iter().any(|c| r.stderr.contains(c.as_str())), "{ctx}: stderr names none of {candidates:?}: {}", r.stderr);
                    let d = &c["detected"];
                    let named = format!("{}: chunk {} at offset {}", s(&d["file"]), n(&d["chunk"]), n(&d["offset"]));
                    assert!(candidates.contains(&named), "{ctx}: vectors.json says {named}, not among {candidates:?}");
                } else {
                    assert!(r.stderr.contains("content hashes to"), "{ctx}: {}", r.stderr);
                }
                checked += 1;
            }
        }
    }
    assert!(checked >= 50, "only {checked} corruption points");
}

#[test]
fn vector_consistent_lies_open_but_fail_verify() {
    let all = vectors();
    let vdir = vectors_dir();
    let lies = all["lies"].as_array().expect("lies");
    assert!(lies.len() >= 3);
    for lie in lies {
        let tag = s(&lie["tag"]);
        let path = vdir.join(s(&lie["layout"]));
        let ctx = format!("{}:{tag}", s(&lie["layout"]));
        // Every digest is consistent: the image opens.
        let (layout, img) = open(&path, tag);
        assert_eq!(img.manifest_digest.as_str(), s(&lie["manifest"]), "{ctx}");
        let report = verify::audit(&layout, &img, &verify::AuditOptions { threads: 2, blob_digests: false, ..Default::default() }).unwrap();
        let want = &lie["expect"];
        let kind = serde_json::to_value(report.failures.iter().map(|f| f.kind).collect::<Vec<_>>()).unwrap();
        assert!(kind.as_array().unwrap().contains(&want["kind"]), "{ctx}: expected a {} failure, got {:?}", want["kind"], report.failures);
        let r = run(snapctl().arg("verify").arg(format!("oci:{}:{tag}", path.display())));
        assert_eq!(r.code, 1, "{ctx}: verify must exit 1\nstderr: {}", r.stderr);
        if let Some(file) = want["file"].as_str() {
            let chunk = n(&want["chunk"]);
            let at = format!("{file}: chunk {chunk} at offset {}", chunk << img.chunk_shift());
            assert!(r.stderr.contains(&at), "{ctx}: stderr does not name {at:?}: {}", r.stderr);
        }
    }
}

/// The worked example of spec/format.md, byte for byte: its index blob decodes to what the
/// annotated hexdump says.
#[test]
fn spec_worked_example_index() {
    let hex: String = include_str!("../../../spec/format.md")
        .split("<!-- example-index-hex -->")
        .nth(1)
        .expect("spec/format.md has the example index hexdump")
        .lines()
        .filter_map(|l| l.split_once(": ").map(|(_, rest)| rest))
        .map(|rest| rest.get(..39).unwrap_or(rest).replace(' ', ""))
        .take_while(|h| h.chars().all(|c| c.is_ascii_hexdigit()))
        .collect();
    let bytes = hex::decode(&hex).expect("hexdump decodes");
    assert_eq!(bytes.len(), 328, "example index length");
    let ix = imgfmt::ChunkIndex::decode(&bytes).expect("example index decodes");
    assert_eq!(ix.encode(), bytes);
    assert_eq!((ix.hash, ix.chunk_shift, ix.layer), (HashAlgo::Blake3, 16, false));
    assert_eq!(ix.files.len(), 1);
    assert_eq!(ix.files[0].size, 131139);
    assert_eq!(ix.packs.len(), 1);
    assert_eq!(ix.packs[0].size, 116);
    let kinds: Vec<_> = ix.records.iter().map(|r| r.kind).collect();
    use imgfmt::compress::Codec;
    use imgfmt::RecordKind::{Stored, Zero};
    assert_eq!(
        kinds,
        [Stored { pack: 0, offset: 0, stored_len: 49, codec: Codec::Zstd }, Zero, Stored { pack: 0, offset: 49, stored_len: 67, codec: Codec::Raw },]
    );
    assert_eq!(ix.records[1].digest, verify::zero_digest(HashAlgo::Blake3, 65536));
    let root = verify::file_root(HashAlgo::Blake3, &ix.records.iter().map(|r| r.digest).collect::<Vec<_>>());
    assert_eq!(root.display_with(HashAlgo::Blake3), "blake3:f389ca230de486c8681a50c5f72110231e688abd62e8495e1bef6f1137d07776");
}

/// A hostile layer whose index claims a 1 PiB file with no records (so every chunk would
/// have to be inherited, and the parent's file has one) must be refused, exit 1, without
/// the reader allocating for 2^34 chunks. All its digests are consistent.
#[test]
fn regression_issue_2_hostile_layer_claiming_a_huge_file_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("chain");
    copy_dir(&vectors_dir().join("chain"), &path);
    let (layout, img) = open(&path, "child");
    let mut config: Value = serde_json::from_slice(&fs::read(blob_path(&path, img.chain[0].config_digest.as_str())).unwrap()).unwrap();
    let mut index = fs::read(blob_path(&path, img.chain[0].index_digest.as_str())).unwrap();
    let fi = img.config().files.iter().position(|f| f.name == "state").unwrap();
    assert_eq!(img.index().files[fi].record_count, 0, "state is inherited whole");
    let size: u64 = 1 << 50;
    index[64 + 32 * fi..64 + 32 * fi + 8].copy_from_slice(&size.to_le_bytes());
    let index_digest = layout.put_blob(&index).unwrap();
    config["files"][fi]["size"] = size.into();
    config["files"][fi]["chunks"] = (size >> 16).into();
    config["index"] = serde_json::json!({"digest": index_digest.as_str(), "size": index.len()});
    let config_bytes = serde_json::to_vec_pretty(&config).unwrap();
    let config_digest = layout.put_blob(&config_bytes).unwrap();
    let mut manifest: Value = serde_json::from_slice(&img.manifest_bytes).unwrap();
    manifest["config"]["digest"] = config_digest.as_str().into();
    manifest["config"]["size"] = config_bytes.len().into();
    for l in manifest["layers"].as_array_mut().unwrap() {
        if l["digest"] == img.chain[0].index_digest.as_str() {
            l["digest"] = index_digest.as_str().into();
        }
    }
    let manifest_digest = layout.put_blob(&serde_json::to_vec(&manifest).unwrap()).unwrap();
    let r = run(snapctl().arg("verify").arg(format!("oci:{}@{manifest_digest}", path.display())));
    assert_eq!(r.code, 1, "verify must refuse the layer, not crash\nstderr: {}", r.stderr);
    assert!(r.stderr.contains("state"), "{}", r.stderr);
}

/// Every pack corruption point of a vector whose image has outboards, read a slice at a
/// time: the slice holding the flipped byte is refused, named by file, chunk, slice and
/// offset, and every other slice of that chunk still verifies.
#[test]
fn vector_pack_corruptions_are_caught_slice_by_slice() {
    let all = vectors();
    let vdir = vectors_dir();
    let mut checked = 0;
    for v in all["vectors"].as_array().expect("vectors") {
        let pristine = vdir.join(s(&v["layout"]));
        for img in v["images"].as_array().unwrap() {
            let tag = s(&img["tag"]);
            let (layout, mut opened) = open(&pristine, tag);
            opened.load_outboards(&layout).unwrap();
            if opened.chain.iter().all(|l| l.outboard.is_none()) {
                continue;
            }
            for c in img["corruptions"].as_array().unwrap().iter().filter(|c| s(&c["blob"]) == "pack") {
                let (digest, offset) = (s(&c["digest"]).parse::<OciDigest>().unwrap(), n(&c["offset"]));
                let ctx = format!("{}:{tag}: {}", s(&v["name"]), s(&c["region"]));
                // The resolved chunk whose stored bytes hold that byte, if it has slices.
                let hit = opened.files.iter().enumerate().find_map(|(fi, f)| {
                    f.chunks.iter().enumerate().find_map(|(ci, ch)| match ch.at {
                        StoredAt::Pack { pack, offset: at, stored_len, .. }
                            if opened.packs[pack as usize].digest == digest && (at..at + stored_len as u64).contains(&offset) =>
                        {
                            opened.slice_cvs(fi, ci as u64).map(|sc| (fi, ci as u64, (offset - at) >> sc.slice_shift, sc.slice_shift, sc.slice_count()))
                        }
                        _ => None,
                    })
                });
                let Some((fi, ci, bad, slice_shift, count)) = hit else { continue };
                let tmp = tempfile::tempdir().unwrap();
                let copy = tmp.path().join("layout");
                copy_dir(&pristine, &copy);
                let p = blob_path(&copy, digest.as_str());
                let mut bytes = fs::read(&p).unwrap();
                bytes[offset as usize] ^= 0x01;
                fs::write(&p, &bytes).unwrap();
                let l = OciLayout::open(&copy).unwrap();
                let e = verify::read_slices(&l, &opened, fi, ci, 0..count).unwrap_err();
                let name = &opened.files[fi].name;
                let want = format!("{name}: chunk {ci} slice {bad} at offset {}: slice CV mismatch", (ci << opened.chunk_shift()) + (bad << slice_shift));
                assert!(e.to_string().starts_with(&want), "{ctx}: {e} (want {want})");
                for r in [0..bad as u32, bad as u32 + 1..count] {
                    if !r.is_empty() {
                        verify::read_slices(&l, &opened, fi, ci, r).unwrap_or_else(|e| panic!("{ctx}: a neighbour slice failed: {e}"));
                    }
                }
                checked += 1;
            }
        }
    }
    assert!(checked >= 4, "only {checked} slice corruption points");
}

/// The slice example of spec/format.md ("Slices of a 10 KiB chunk"), byte for byte: the
/// outboard hexdump decodes, its CVs are those of the stated bytes at their offsets, they
/// merge to the stated digest, and the stated tampered CV is what slice 1 gives then.
#[test]
fn spec_worked_example_outboard() {
    let spec = include_str!("../../../spec/format.md");
    let hex: String = spec
        .split("<!-- example-outboard-hex -->")
        .nth(1)
        .expect("spec/format.md has the example outboard hexdump")
        .lines()
        .filter_map(|l| l.split_once(": ").map(|(_, rest)| rest))
        .map(|rest| rest.get(..39).unwrap_or(rest).replace(' ', ""))
        .take_while(|h| h.chars().all(|c| c.is_ascii_hexdigit()))
        .collect();
    let bytes = hex::decode(&hex).expect("hexdump decodes");
    assert_eq!(bytes.len(), 176);
    assert_eq!(OciDigest::of(&bytes).as_str(), "sha256:693a05f58567e641d42704dfc06d9f1ac5d41f1bcb0f4edacf5c2c98860f50a9");
    let ob = imgfmt::Outboard::decode(&bytes).expect("example outboard decodes");
    assert_eq!(ob.encode(), bytes);
    assert_eq!((ob.chunk_shift, ob.slice_shift, ob.entries.len(), ob.cvs.len()), (16, 12, 1, 3));
    let data: Vec<u8> = (0..10240u32).map(|i| (i % 251) as u8).collect();
    let digest = verify::chunk_digest(HashAlgo::Blake3, &data);
    assert_eq!(digest.to_hex(), "dccc225642830d32489c56d1e65478fb790324dc9ebbcc0de9aaa64944e6fe7e");
    let e = ob.find(&digest).expect("the entry is keyed by the chunk digest");
    assert_eq!(e.chunk_len, 10240);
    assert_eq!(e.cvs, verify::hash::slice_cvs(&data, 12).as_slice());
    let hexes: Vec<String> = e.cvs.iter().map(hex::encode).collect();
    for h in &hexes {
        assert!(spec.contains(h.as_str()), "spec states CV {h}");
    }
    assert_eq!(verify::hash::merge_slice_cvs(e.cvs), digest);
    let mut t = data[4096..8192].to_vec();
    t[5000 - 4096] ^= 1;
    let tampered = hex::encode(verify::hash::slice_cv(&t, 4096));
    assert_eq!(tampered, "22264680565ed69d818516db34b50952c9d54cf02cfd1046c827f79da936ca20");
    assert_ne!(verify::hash::slice_cv(&data[4096..8192], 0), e.cvs[1], "a CV binds its offset");
}
