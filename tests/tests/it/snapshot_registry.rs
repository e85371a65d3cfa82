//! Snapshot images through real OCI registries, carried by skopeo: `snapctl serve` and
//! Debian's docker-registry (distribution 2.8). An image packed by snapctl, copied in and
//! back out, must keep its manifest digest, verify, and unpack byte-identical — a layer
//! included, since its manifest lists every blob it needs. snapctl's read commands also
//! work on the registry reference itself.

use std::fs;
use std::path::Path;
use std::process::Command;

use snapctl_tests::registry_support::{Distribution, Serve};
use snapctl_tests::{have, run, snapctl};

fn skopeo(src: &str, dst: &str) -> snapctl_tests::Run {
    run(Command::new("skopeo").args(["copy", "--quiet", "--preserve-digests", "--src-tls-verify=false", "--dest-tls-verify=false", src, dst]))
}

fn pack(src: &Path, dest: &str, extra: &[&str]) -> String {
    let r = run(snapctl().arg("pack").arg(src).arg(dest).args(extra));
    assert_eq!(r.code, 0, "{r:?}");
    r.stdout.trim().to_string()
}

/// Pack a base and a layer, push both through `registry_addr` with skopeo, pull each into
/// a fresh layout, and check digest, verify and unpack.
fn round_trip_through(registry_addr: &str, work: &Path) {
    let snap = work.join("snap");
    let r = run(snapctl().arg("sample").arg(&snap).args(["--size", "24MiB"]));
    assert_eq!(r.code, 0, "{r:?}");
    let lay = work.join("layout");
    let v1 = pack(&snap, &format!("oci:{}:v1", lay.display()), &["--compress", "zstd:1"]);
    let r = run(snapctl().arg("sample").arg(&snap).args(["--size", "24MiB", "--mutate", "3"]));
    assert_eq!(r.code, 0, "{r:?}");
    let v2 = pack(&snap, &format!("oci:{}:v2", lay.display()), &["--compress", "zstd:1", "--parent", &format!("oci:{}:v1", lay.display())]);

    for (tag, digest) in [("v1", &v1), ("v2", &v2)] {
        let remote = format!("docker://{registry_addr}/sandboxes/vm:{tag}");
        let r = skopeo(&format!("oci:{}:{tag}", lay.display()), &remote);
        assert_eq!(r.code, 0, "push {tag}: {r:?}");
        // A fresh layout holding only what the registry gives back for this one tag.
        let back = work.join(format!("back-{tag}"));
        let r = skopeo(&remote, &format!("oci:{}:{tag}", back.display()));
        assert_eq!(r.code, 0, "pull {tag}: {r:?}");
        let idx: serde_json::Value = serde_json::from_slice(&fs::read(back.join("index.json")).unwrap()).unwrap();
        assert_eq!(idx["manifests"][0]["digest"].as_str().unwrap(), digest.as_str(), "{tag}: manifest digest preserved");
        let bref = format!("oci:{}:{tag}", back.display());
        let r = run(snapctl().args(["verify", &bref]));
        assert_eq!(r.code, 0, "verify {tag} after the round trip: {r:?}");
        let out = work.join(format!("out-{tag}"));
        let r = run(snapctl().args(["unpack", &bref]).arg(&out));
        assert_eq!(r.code, 0, "unpack {tag}: {r:?}");
        if tag == "v2" {
            for f in ["vm.mem", "vm.state"] {
                assert!(fs::read(out.join(f)).unwrap() == fs::read(snap.join(f)).unwrap(), "{f} differs after the registry round trip");
            }
        }
        let r = run(snapctl().args(["verify", &bref, "--against"]).arg(&out));
        assert_eq!(r.code, 0, "{r:?}");

        // Read commands also work on the registry reference directly (byte ranges of packs).
        let rref = format!("{registry_addr}/sandboxes/vm:{tag}");
        let r = run(snapctl().args(["verify", &rref]));
        assert_eq!(r.code, 0, "verify {rref}: {r:?}");
        let direct = work.join(format!("direct-{tag}"));
        let r = run(snapctl().args(["unpack", &rref]).arg(&direct));
        assert_eq!(r.code, 0, "unpack {rref}: {r:?}");
        let r = run(snapctl().args(["verify", &rref, "--against"]).arg(&direct));
        assert_eq!(r.code, 0, "{r:?}");
        let r = run(snapctl().args(["diff", &bref, &rref]));
        assert_eq!(r.code, 0, "same image in layout and registry: {r:?}");
        let r = run(snapctl().args(["inspect", &format!("{registry_addr}/sandboxes/vm@{digest}"), "--json"]));
        assert_eq!(r.code, 0, "{r:?}");
        let j: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
        assert_eq!(j["manifest"].as_str().unwrap(), digest.as_str());
    }
    let r = run(snapctl().args(["verify", &format!("{registry_addr}/sandboxes/vm:missing")]));
    assert_eq!(r.code, 2, "a missing tag cannot be checked: {r:?}");
    assert!(r.stderr.contains("missing"), "{}", r.stderr);
}

#[test]
fn snapshot_through_snapctl_serve_with_skopeo() {
    if !have("skopeo") {
        return;
    }
    let work = tempfile::tempdir().unwrap();
    let storage = work.path().join("storage");
    let serve = Serve::start(storage.to_str().unwrap(), &[], &[]);
    round_trip_through(&serve.addr, work.path());
}

#[test]
fn snapshot_through_docker_registry_with_skopeo() {
    if !have("skopeo") || !have("docker-registry") {
        return;
    }
    let work = tempfile::tempdir().unwrap();
    let reg = Distribution::start(work.path());
    round_trip_through(&reg.addr, work.path());
}

/// Issue 4: a registry read whose body is cut short after the status line (a reset, or a
/// truncated response) used to fail `unpack`/`verify` from a registry with exit 2; the
/// client now asks again for the bytes still missing, within its retry budget.
#[test]
fn regression_issue_4_range_read_resumes_a_cut_body() {
    use snapctl_tests::fault_proxy::{Fault, FaultProxy, Match, Rule};
    let work = tempfile::tempdir().unwrap();
    let storage = work.path().join("storage");
    let serve = Serve::start(storage.to_str().unwrap(), &[], &[]);
    let snap = work.path().join("snap");
    let r = run(snapctl().arg("sample").arg(&snap).args(["--size", "16MiB"]));
    assert_eq!(r.code, 0, "{r:?}");
    let lay = format!("oci:{}:v1", work.path().join("layout").display());
    pack(&snap, &lay, &[]);
    let r = run(snapctl().args(["push", &lay, &format!("{}/sandboxes/cut:v1", serve.addr)]));
    assert_eq!(r.code, 0, "{r:?}");

    let proxy = FaultProxy::start(serve.addr.as_str()).unwrap();
    // Blob GETs 1 and 2 are the config and the index; the rest are pack ranges.
    proxy.add(Rule::new(Fault::Truncate { after: 100 * 1024 }).on(Match::blob_gets()).nth(3).times(2));
    proxy.add(Rule::new(Fault::Reset { after: 4096 }).on(Match::blob_gets()).nth(6));
    let out = work.path().join("out");
    let r = run(snapctl().args(["unpack", &format!("{}/sandboxes/cut:v1", proxy.addr)]).arg(&out));
    assert_eq!(r.code, 0, "unpack through cut bodies: {r:?}");
    assert!(proxy.faults() >= 2, "the faults were injected ({} seen)", proxy.faults());
    for f in ["vm.mem", "vm.state"] {
        assert!(fs::read(snap.join(f)).unwrap() == fs::read(out.join(f)).unwrap(), "{f} differs");
    }
}
