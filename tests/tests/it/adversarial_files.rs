//! A hostile peer against snapctl's files (issue 14, "Data and files" and "Input"): what
//! someone else planted in a destination (symlinks and hard links under the names a pull
//! takes over, a subdirectory that is a symlink, a symlink with the right bytes under a
//! final name), a pull killed between its renames, images whose config is a consistent
//! lie (names that forge terminal output, a name that is also a directory, set-uid
//! modes), a layout shared with skopeo and oras, a referrers index another client wrote,
//! and the temp blobs of a killed pack.
//!
//! Images are packed by `snapctl pack` into a local layout and pulled from `oci:` (the
//! pull path is the same as from a registry); hostile configs are written directly into
//! the layout with every digest recomputed, so only the rules under test can refuse them.

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant, SystemTime};

use imgfmt::{BlobSource, ChunkDigest, HashAlgo, Image, OciLayout};
use serde_json::Value;
use snapctl_tests::registry_support::{random_bytes, Distribution};
use snapctl_tests::{have, run, snapctl, Run};

fn ok(r: &Run) {
    assert_eq!(r.code, 0, "{r:?}");
}

/// A source directory `name` under `tmp` with `files` (relative name, bytes, mode).
fn source(tmp: &Path, name: &str, files: &[(&str, Vec<u8>, u32)]) -> PathBuf {
    let dir = tmp.join(name);
    for (rel, bytes, mode) in files {
        let p = dir.join(rel);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(&p, bytes).unwrap();
        fs::set_permissions(&p, fs::Permissions::from_mode(*mode)).unwrap();
    }
    dir
}

/// Pack `src` into the layout `lay` as `tag`; the reference `oci:<lay>:<tag>`.
fn pack(src: &Path, lay: &Path, tag: &str) -> String {
    let r = format!("oci:{}:{tag}", lay.display());
    ok(&run(snapctl().arg("pack").arg(src).arg(&r).args(["--chunk-size", "64KiB"])));
    r
}

/// `snapctl pull IMAGE DEST --no-cache --json EXTRA`, and its report when it succeeded.
fn pull(image: &str, dest: &Path, extra: &[&str]) -> (Run, Value) {
    let r = run(snapctl().args(["pull", image]).arg(dest).args(["--no-cache", "--json"]).args(extra));
    let j = if r.code == 0 { serde_json::from_str(&r.stdout).unwrap_or_else(|e| panic!("{e}: {}", r.stdout)) } else { Value::Null };
    (r, j)
}

fn n(j: &Value, k: &str) -> u64 {
    j[k].as_u64().unwrap_or_else(|| panic!("{k} missing in {j}"))
}

/// An 8 MiB sample snapshot packed as `oci:<tmp>/l:v1`: (its source dir, the reference).
fn sample(tmp: &Path) -> (PathBuf, String) {
    let src = tmp.join("snap");
    ok(&run(snapctl().arg("sample").arg(&src).args(["--size", "8MiB"])));
    let r = pack(&src, &tmp.join("l"), "v1");
    (src, r)
}

const PRECIOUS: &[u8] = b"precious: not the image's to write\n";

/// Issue 14 §1: a symlink planted under the name of a dead pull's partial file is not
/// taken over: the image's bytes do not go into its target, `vm.mem` is a regular file.
#[test]
fn regression_issue_14_pull_does_not_take_over_a_planted_symlink() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, image) = sample(tmp.path());
    let victim = tmp.path().join("victim");
    fs::write(&victim, PRECIOUS).unwrap();
    let dest = tmp.path().join("out");
    fs::create_dir_all(&dest).unwrap();
    std::os::unix::fs::symlink(&victim, dest.join(".vm.mem.snapctl-partial-999999-0-1")).unwrap();
    let (r, j) = pull(&image, &dest, &[]);
    ok(&r);
    assert!(fs::read(&victim).unwrap() == PRECIOUS, "the image was written through the symlink");
    let md = fs::symlink_metadata(dest.join("vm.mem")).unwrap();
    assert!(md.file_type().is_file(), "vm.mem is a {:?}", md.file_type());
    assert!(fs::read(dest.join("vm.mem")).unwrap() == fs::read(src.join("vm.mem")).unwrap());
    assert_eq!(n(&j, "resumed_chunks"), 0, "{j}");
    assert_eq!(fs::read_dir(&dest).unwrap().count(), 2, "the planted name is gone, nothing else left");
}

/// Issue 14 §1: a hard link planted under a partial file's name (a second name for a
/// file elsewhere) is not taken over either.
#[test]
fn regression_issue_14_pull_does_not_take_over_a_planted_hard_link() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, image) = sample(tmp.path());
    let victim = tmp.path().join("victim");
    fs::write(&victim, PRECIOUS).unwrap();
    let dest = tmp.path().join("out");
    fs::create_dir_all(&dest).unwrap();
    fs::hard_link(&victim, dest.join(".vm.state.snapctl-partial-999999-0-1")).unwrap();
    let (r, _) = pull(&image, &dest, &[]);
    ok(&r);
    assert!(fs::read(&victim).unwrap() == PRECIOUS, "the image was written into a hard-linked victim");
    for f in ["vm.mem", "vm.state"] {
        let md = fs::symlink_metadata(dest.join(f)).unwrap();
        assert!(md.file_type().is_file() && md.nlink() == 1, "{f}: {md:?}");
        assert!(fs::read(dest.join(f)).unwrap() == fs::read(src.join(f)).unwrap(), "{f}");
    }
    assert_eq!(fs::metadata(&victim).unwrap().nlink(), 1, "the planted link was dropped");
}

/// Issue 14 §1: a subdirectory of the destination that is a symlink makes pull and
/// unpack fail before writing anything, and nothing lands where it points.
#[test]
fn regression_issue_14_pull_and_unpack_refuse_a_symlinked_subdirectory() {
    let tmp = tempfile::tempdir().unwrap();
    let src = source(tmp.path(), "src", &[("sub/data.bin", random_bytes(1, 300_000), 0o644), ("top.bin", random_bytes(2, 70_000), 0o644)]);
    let image = pack(&src, &tmp.path().join("l"), "v1");
    for cmd in ["pull", "unpack"] {
        let outside = tmp.path().join(format!("outside-{cmd}"));
        let dest = tmp.path().join(format!("out-{cmd}"));
        fs::create_dir_all(&outside).unwrap();
        fs::create_dir_all(&dest).unwrap();
        std::os::unix::fs::symlink(&outside, dest.join("sub")).unwrap();
        let mut c = snapctl();
        c.args([cmd, &image]).arg(&dest);
        if cmd == "pull" {
            c.arg("--no-cache");
        }
        let r = run(&mut c);
        assert_eq!(r.code, 2, "{cmd}: {r:?}");
        assert!(r.stderr.contains("symlink"), "{cmd}: {}", r.stderr);
        assert_eq!(fs::read_dir(&outside).unwrap().count(), 0, "{cmd} wrote outside the destination");
        // --overwrite changes nothing about it.
        c.arg("--overwrite");
        assert_eq!(run(&mut c).code, 2, "{cmd} --overwrite");
        assert_eq!(fs::read_dir(&outside).unwrap().count(), 0, "{cmd} --overwrite wrote outside the destination");
    }
}

/// Issue 14 §4: a pull killed between its renames (`vm.mem` in place, `vm.state` still a
/// partial file) is finished by a rerun, without --overwrite: the file in place is
/// checked whole and kept, only the rest is fetched. A file in place that differs by one
/// byte, or a symlink to a file with the right bytes, is not kept.
#[test]
fn regression_issue_14_pull_killed_between_renames_is_finished_by_a_rerun() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, image) = sample(tmp.path());
    let full_dest = tmp.path().join("full");
    let (r, full) = pull(&image, &full_dest, &[]);
    ok(&r);

    // What the kill left: vm.mem renamed into place (as the pull wrote it: complete,
    // synced, its mode set), vm.state under a dead pid's partial name, half written.
    let dest = tmp.path().join("out");
    fs::create_dir_all(&dest).unwrap();
    fs::copy(full_dest.join("vm.mem"), dest.join("vm.mem")).unwrap();
    let state = fs::read(full_dest.join("vm.state")).unwrap();
    let partial = dest.join(".vm.state.snapctl-partial-999999-0-1");
    fs::write(&partial, &state[..state.len() / 2]).unwrap();
    fs::OpenOptions::new().write(true).open(&partial).unwrap().set_len(state.len() as u64).unwrap();

    let (r, j) = pull(&image, &dest, &[]);
    ok(&r);
    for f in ["vm.mem", "vm.state"] {
        assert!(fs::read(dest.join(f)).unwrap() == fs::read(src.join(f)).unwrap(), "{f}");
    }
    assert_eq!(n(&j, "in_place_files"), 1, "{j}");
    assert!(n(&j, "bytes_fetched") < n(&full, "bytes_fetched") / 4, "the rerun fetched {} of a full {}", j["bytes_fetched"], full["bytes_fetched"]);
    assert_eq!(fs::read_dir(&dest).unwrap().count(), 2, "no partial file left");
    // Run again: everything is in place, nothing is fetched.
    let (r, j) = pull(&image, &dest, &[]);
    ok(&r);
    assert_eq!((n(&j, "in_place_files"), n(&j, "bytes_fetched")), (2, 0), "{j}");

    // One byte different: not the image's file, not replaced without --overwrite.
    let bad = tmp.path().join("bad");
    fs::create_dir_all(&bad).unwrap();
    let mut mem = fs::read(full_dest.join("vm.mem")).unwrap();
    let at = mem.iter().position(|&b| b != 0).unwrap();
    mem[at] ^= 1;
    fs::write(bad.join("vm.mem"), &mem).unwrap();
    let (r, _) = pull(&image, &bad, &[]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("already exists"), "{}", r.stderr);
    assert!(fs::read(bad.join("vm.mem")).unwrap() == mem, "a refused pull left the file as it was");
    let (r, j) = pull(&image, &bad, &["--overwrite"]);
    ok(&r);
    assert_eq!(n(&j, "in_place_files"), 0, "{j}");
    assert!(fs::read(bad.join("vm.mem")).unwrap() == fs::read(src.join("vm.mem")).unwrap());

    // A symlink to a file holding exactly the right bytes is still not "in place".
    let linked = tmp.path().join("linked");
    fs::create_dir_all(&linked).unwrap();
    let copy = tmp.path().join("right-bytes");
    fs::copy(src.join("vm.mem"), &copy).unwrap();
    std::os::unix::fs::symlink(&copy, linked.join("vm.mem")).unwrap();
    let (r, _) = pull(&image, &linked, &[]);
    assert_eq!(r.code, 2, "{r:?}");
    let (r, j) = pull(&image, &linked, &["--overwrite"]);
    ok(&r);
    assert_eq!(n(&j, "in_place_files"), 0, "{j}");
    assert!(fs::symlink_metadata(linked.join("vm.mem")).unwrap().is_file(), "the symlink was replaced, not followed");
    assert!(fs::read(&copy).unwrap() == fs::read(src.join("vm.mem")).unwrap(), "the symlink's target untouched");
}

/// Issue 14 §15: modes up to 0o7777 in an image are applied as `mode & 0o775`: a root
/// pull or unpack creates no set-uid, set-gid or world-writable file.
#[test]
fn regression_issue_14_modes_are_masked_on_pull_and_unpack() {
    let tmp = tempfile::tempdir().unwrap();
    let src = source(
        tmp.path(),
        "src",
        &[("suid", random_bytes(3, 5000), 0o6777), ("shared", random_bytes(4, 5000), 0o666), ("plain", random_bytes(5, 5000), 0o640)],
    );
    let image = pack(&src, &tmp.path().join("l"), "v1");
    let r = run(snapctl().args(["inspect", &image, "--json"]));
    ok(&r);
    let j: Value = serde_json::from_str(&r.stdout).unwrap();
    assert!(j["files"].as_array().unwrap().iter().any(|f| f["mode"] == "6777"), "the image records what the source had: {j}");
    for cmd in ["pull", "unpack"] {
        let dest = tmp.path().join(cmd);
        let mut c = snapctl();
        c.args([cmd, &image]).arg(&dest);
        if cmd == "pull" {
            c.arg("--no-cache");
        }
        ok(&run(&mut c));
        for (f, want) in [("suid", 0o775), ("shared", 0o664), ("plain", 0o640)] {
            let mode = fs::metadata(dest.join(f)).unwrap().mode() & 0o7777;
            assert_eq!(mode, want, "{cmd} {f}: {mode:o}");
        }
        // The result still verifies against the image.
        ok(&run(snapctl().args(["verify", &image, "--against"]).arg(&dest)));
    }
}

/// Rewrite the config of the image `tag` in the layout `lay` with `edit`, keeping every
/// digest consistent (content root recomputed from the edited files, manifest annotation,
/// config and manifest digests), and return `oci:<lay>@<new manifest>`: a lie that only
/// the format's rules can refuse.
fn rewrite_config(lay: &Path, tag: &str, edit: impl FnOnce(&mut Value)) -> String {
    let layout = OciLayout::open(lay).unwrap();
    let img = Image::open(&layout, &layout.resolve_tag(tag).unwrap()).unwrap();
    let mut config: Value = serde_json::from_slice(&layout.read_blob_unverified(&img.chain[0].config_digest, 1 << 24).unwrap()).unwrap();
    edit(&mut config);
    let algo: HashAlgo = config["hash"].as_str().unwrap().parse().unwrap();
    let files: Vec<(String, u64, ChunkDigest)> = config["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| (f["name"].as_str().unwrap().to_string(), f["size"].as_u64().unwrap(), ChunkDigest::parse_with(f["root"].as_str().unwrap(), algo).unwrap()))
        .collect();
    let root = verify::image_root(algo, files.iter().map(|(n, s, r)| (n.as_str(), *s, *r))).display_with(algo);
    config["root"] = root.clone().into();
    let config_bytes = serde_json::to_vec_pretty(&config).unwrap();
    let config_digest = layout.put_blob(&config_bytes).unwrap();
    let mut manifest: Value = serde_json::from_slice(&img.manifest_bytes).unwrap();
    manifest["config"]["digest"] = config_digest.as_str().into();
    manifest["config"]["size"] = config_bytes.len().into();
    manifest["annotations"][imgfmt::media::ANN_ROOT] = root.into();
    let manifest_digest = layout.put_blob(&serde_json::to_vec(&manifest).unwrap()).unwrap();
    format!("oci:{}@{manifest_digest}", lay.display())
}

/// Issue 14 §16: a name holding ESC and a newline (which, printed, clears the screen and
/// starts a line of its own) is refused by the decoder: inspect, verify and pull fail,
/// and no raw control character reaches either stream.
#[test]
fn regression_issue_14_names_that_forge_output_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let src = source(tmp.path(), "src", &[("a", random_bytes(6, 70_000), 0o644), ("b", random_bytes(7, 1000), 0o644)]);
    let lay = tmp.path().join("l");
    pack(&src, &lay, "v1");
    let forged = "b\x1b[2J\x1b[H\nverified oci:l:v1: 0 failures";
    let image = rewrite_config(&lay, "v1", |c| c["files"][1]["name"] = forged.into());
    for args in [vec!["inspect", &image], vec!["verify", &image]] {
        let r = run(snapctl().args(&args));
        assert_ne!(r.code, 0, "{args:?} accepted the name: {r:?}");
        assert!(r.stderr.contains("control character"), "{args:?}: {}", r.stderr);
        for (s, stream) in [(&r.stdout, "stdout"), (&r.stderr, "stderr")] {
            assert!(!s.contains('\x1b'), "{args:?}: ESC on {stream}: {s:?}");
            assert!(!s.contains("\nverified"), "{args:?}: a forged line on {stream}: {s:?}");
        }
    }
    let dest = tmp.path().join("out");
    let (r, _) = pull(&image, &dest, &[]);
    assert_ne!(r.code, 0, "{r:?}");
    assert!(!r.stderr.contains('\x1b'), "{:?}", r.stderr);
    assert!(fs::read_dir(&dest).map(|d| d.count()).unwrap_or(0) == 0, "a refused image wrote files");
}

/// Issue 14 §17: an image holding both `a` and `a/x` (which no directory can hold)
/// is refused when decoded, by verify as by pull, instead of verifying and never pulling.
#[test]
fn regression_issue_14_a_file_that_is_also_a_directory_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let src = source(tmp.path(), "src", &[("a", random_bytes(8, 70_000), 0o644), ("b/x", random_bytes(9, 1000), 0o644)]);
    let lay = tmp.path().join("l");
    pack(&src, &lay, "v1");
    let image = rewrite_config(&lay, "v1", |c| c["files"][1]["name"] = "a/x".into());
    let r = run(snapctl().args(["verify", &image]));
    assert_eq!(r.code, 1, "verify must refuse the image: {r:?}");
    assert!(r.stderr.contains("also a directory"), "{}", r.stderr);
    let (r, _) = pull(&image, &tmp.path().join("out"), &[]);
    assert_ne!(r.code, 0, "{r:?}");
    assert!(r.stderr.contains("also a directory"), "{}", r.stderr);
}

/// The entries of `index.json` in the layout `lay`.
fn index_entries(lay: &Path) -> (Value, Vec<Value>) {
    let idx: Value = serde_json::from_slice(&fs::read(lay.join("index.json")).unwrap()).unwrap();
    let entries = idx["manifests"].as_array().unwrap().clone();
    (idx, entries)
}

/// Issue 14 §3: `snapctl pack` into a layout skopeo also writes keeps every field of
/// every entry it did not write, and of the index, as a Go tool (oras, buildkit) may add
/// them: `platform`, `urls`, `data`, `artifactType`, `subject`, unknown keys. skopeo and
/// oras (python) still read the layout afterwards.
#[test]
fn regression_issue_14_pack_into_a_shared_layout_keeps_what_others_wrote() {
    if !have("skopeo") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let lay = tmp.path().join("shared");
    // skopeo writes an image (an OCI artifact layout it copies) into the shared layout.
    let other = tmp.path().join("other");
    let other_digest = snapctl_tests::registry_support::oci_layout(&other, "x", &[(11, 4096)]);
    ok(&run(std::process::Command::new("skopeo")
        .args(["copy", "--quiet", "--preserve-digests"])
        .arg(format!("oci:{}:x", other.display()))
        .arg(format!("oci:{}:theirs", lay.display()))));
    // ... and the fields other writers put in an index.
    let mut idx: Value = serde_json::from_slice(&fs::read(lay.join("index.json")).unwrap()).unwrap();
    let theirs = &mut idx["manifests"][0];
    assert_eq!(theirs["digest"], other_digest.as_str());
    theirs["platform"] = serde_json::json!({"architecture": "arm64", "os": "linux", "variant": "v8", "os.features": ["x"]});
    theirs["urls"] = serde_json::json!(["https://mirror.example/blob"]);
    theirs["data"] = "e30=".into();
    theirs["artifactType"] = "application/vnd.example.thing".into();
    theirs["annotations"]["io.example.note"] = "kept".into();
    theirs["io.example.unknown"] = serde_json::json!({"nested": [1, 2]});
    idx["annotations"] = serde_json::json!({"io.example.index": "kept"});
    idx["subject"] = serde_json::json!({"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": other_digest, "size": 1});
    idx["io.example.top"] = true.into();
    fs::write(lay.join("index.json"), serde_json::to_vec(&idx).unwrap()).unwrap();
    let (before, before_entries) = index_entries(&lay);

    let snap = tmp.path().join("snap");
    ok(&run(snapctl().arg("sample").arg(&snap).args(["--size", "2MiB"])));
    pack(&snap, &lay, "ours");
    pack(&snap, &lay, "ours"); // a tag moved: the rewrite path, twice
    let (after, after_entries) = index_entries(&lay);
    assert_eq!(after_entries[0], before_entries[0], "the other tool's entry, field for field");
    for k in ["annotations", "subject", "io.example.top", "schemaVersion"] {
        assert_eq!(after[k], before[k], "index field {k}");
    }
    assert_eq!(after_entries.len(), 2, "{after}");

    // The other tools still read the layout; snapctl reads its own image.
    ok(&run(std::process::Command::new("skopeo").args(["inspect", "--raw"]).arg(format!("oci:{}:theirs", lay.display()))));
    let py = format!("import oras.layout.layout as l; print(len(l.Layout('{}').get_ordered_blobs('theirs')))", lay.display());
    let r = run(std::process::Command::new("python3").args(["-c", &py]));
    if r.stderr.contains("No module named") {
        assert!(!snapctl_tests::require_peers(), "python oras is required: {}", r.stderr);
    } else {
        ok(&r);
        assert_eq!(r.stdout.trim(), "3", "oras lists the other image's blobs: {r:?}");
    }
    ok(&run(snapctl().args(["verify", &format!("oci:{}:ours", lay.display())])));
}

/// Issue 14 §3: the referrers fallback index (kept by the pushing client where the
/// registry has no referrers API) is extended without dropping what another client
/// wrote in it.
#[test]
fn regression_issue_14_referrers_fallback_index_keeps_what_others_wrote() {
    if !have("docker-registry") || !have("skopeo") {
        return;
    }
    let store = tempfile::tempdir().unwrap();
    let reg = Distribution::start(store.path());
    let tmp = tempfile::tempdir().unwrap();
    let lay = tmp.path().join("l");
    let subject = snapctl_tests::registry_support::oci_layout(&lay, "v1", &[(12, 4096)]);
    ok(&run(std::process::Command::new("skopeo")
        .args(["copy", "--quiet", "--preserve-digests", "--dest-tls-verify=false"])
        .arg(format!("oci:{}:v1", lay.display()))
        .arg(format!("docker://{}/vm/refs:v1", reg.addr))));
    let subject: imgfmt::OciDigest = subject.parse().unwrap();
    let c = regclient::RegistrySource::new(&reg.addr, "vm/refs", true, None).unwrap();
    let subject_size = fs::metadata(lay.join("blobs/sha256").join(subject.hex())).unwrap().len();
    // Another client's fallback index: an entry with fields snapctl does not model.
    let tag = format!("sha256-{}", subject.hex());
    let theirs = serde_json::json!({
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "digest": subject.as_str(),
        "size": subject_size,
        "artifactType": "application/vnd.example.sbom",
        "platform": {"architecture": "amd64", "os": "linux"},
        "annotations": {"io.example.by": "another client"},
        "io.example.unknown": [1, 2, 3]
    });
    let index = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [theirs.clone()],
        "annotations": {"io.example.index": "kept"},
        "io.example.top": {"k": "v"}
    });
    c.put_manifest(&tag, &serde_json::to_vec(&index).unwrap()).unwrap();
    c.push_referrer(&subject, "application/vnd.snapctl.trace.v1", b"pages 1 2", Default::default()).unwrap();
    let url = format!("http://{}/v2/vm/refs/manifests/{tag}", reg.addr);
    let body = reqwest::blocking::Client::new().get(&url).header("Accept", "application/vnd.oci.image.index.v1+json").send().unwrap().text().unwrap();
    let after: Value = serde_json::from_str(&body).unwrap();
    let entries = after["manifests"].as_array().unwrap();
    assert_eq!(entries.len(), 2, "{after}");
    assert_eq!(entries[0], theirs, "the other client's entry, field for field");
    assert_eq!(after["annotations"], index["annotations"]);
    assert_eq!(after["io.example.top"], index["io.example.top"]);
}

/// Files named `.tmp-blob-*` in the layout's blob directory.
fn temp_blobs(lay: &Path) -> Vec<PathBuf> {
    fs::read_dir(lay.join("blobs/sha256"))
        .map(|rd| rd.flatten().filter(|e| e.file_name().to_string_lossy().starts_with(".tmp-blob-")).map(|e| e.path()).collect())
        .unwrap_or_default()
}

/// Issue 14 §5: a pack killed mid-way leaves its temp blob; the next pack into the
/// layout removes it once it is stale (old, its pid gone, its lock free), and leaves a
/// live pack's alone.
#[test]
fn regression_issue_14_a_killed_packs_temp_blobs_are_removed_by_the_next_pack() {
    let tmp = tempfile::tempdir().unwrap();
    let snap = tmp.path().join("snap");
    ok(&run(snapctl().arg("sample").arg(&snap).args(["--size", "256MiB"])));
    let lay = tmp.path().join("l");
    let mut child = snapctl()
        .arg("pack")
        .arg(&snap)
        .arg(format!("oci:{}:v1", lay.display()))
        .args(["--compress", "zstd:19"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if temp_blobs(&lay).iter().any(|p| fs::metadata(p).is_ok_and(|m| m.len() > 0)) {
            break;
        }
        assert!(child.try_wait().unwrap().is_none(), "the pack finished before it could be killed");
        assert!(Instant::now() < deadline, "no temp blob within 60 s");
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let left = temp_blobs(&lay);
    assert!(!left.is_empty(), "the killed pack left no temp blob");
    // Age them past the grace a writer gets between its create and its lock.
    let old = SystemTime::now() - Duration::from_secs(3600);
    for p in &left {
        fs::File::options().write(true).open(p).unwrap().set_modified(old).unwrap();
    }
    // A live writer's temp blob (held locked, as every writer holds its own): kept.
    let live = lay.join("blobs/sha256/.tmp-blob-999999-0-1");
    let held = fs::File::options().write(true).create_new(true).open(&live).unwrap();
    held.try_lock().unwrap();
    held.set_modified(old).unwrap();

    let small = tmp.path().join("small");
    ok(&run(snapctl().arg("sample").arg(&small).args(["--size", "1MiB"])));
    pack(&small, &lay, "v2");
    assert_eq!(temp_blobs(&lay), vec![live.clone()], "the killed pack's temp blobs are gone, the locked one kept");
    drop(held);
    ok(&run(snapctl().args(["verify", &format!("oci:{}:v2", lay.display())])));
}

/// Issue 21: `verify` followed a chain of `base` images with no depth bound. It now
/// follows bases as deep as readers follow parents (`MAX_CHAIN_DEPTH`, 64), and a deeper
/// chain is an error that says so.
#[test]
fn regression_issue_21_verify_bounds_the_chain_of_bases() {
    let tmp = tempfile::tempdir().unwrap();
    let layout = tmp.path().join("layout");
    let snap = tmp.path().join("snap");
    let r = snapctl_tests::run(snapctl_tests::snapctl().arg("sample").arg(&snap).args(["--size", "64KiB"]));
    assert_eq!(r.code, 0, "{r:?}");
    let depth = imgfmt::config::MAX_CHAIN_DEPTH + 2;
    for i in 0..depth {
        let mut c = snapctl_tests::snapctl();
        c.arg("pack").arg(&snap).arg(format!("oci:{}:b{i}", layout.display())).args(["--chunk-size", "64KiB"]);
        if i > 0 {
            c.args(["--base", &format!("oci:{}:b{}", layout.display(), i - 1)]);
        }
        let r = snapctl_tests::run(&mut c);
        assert_eq!(r.code, 0, "pack {i}: {r:?}");
    }
    let r = snapctl_tests::run(snapctl_tests::snapctl().args(["verify", &format!("oci:{}:b{}", layout.display(), depth - 1)]));
    assert_eq!(r.code, 2, "verify of a chain of {depth} bases: {r:?}");
    assert!(r.stderr.contains("base chain depth"), "{}", r.stderr);
    let r = snapctl_tests::run(snapctl_tests::snapctl().args(["verify", &format!("oci:{}:b{}", layout.display(), depth - 3)]));
    assert_eq!(r.code, 0, "a chain of {} bases is within the bound: {r:?}", depth - 2);
}
