//! `copy` carries what is attached to an image (issue 22 §4): an SBOM `oras attach`ed, a
//! cosign signature (tag scheme, and OCI 1.1 referrer), a snapctl trace with its
//! working-set blob; to a second `snapctl serve` and to distribution 2.8 (no referrers
//! API), where `cosign verify` accepts the signature and `oras discover` lists the SBOM.

use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use serde_json::Value;
use snapctl_tests::registry_support::{Distribution, Serve};
use snapctl_tests::{have, require_peers, run, Run, Work};

const COSIGN: &str = "/opt/snapctl-cosign/cosign";
const ORAS: &str = "/opt/snapctl-oras/oras";
const SBOM_TYPE: &str = "application/spdx+json";

/// Whether `path` (a peer installed by scripts/setup.sh outside PATH) is there; skips
/// loudly, or fails under SNAPCTL_REQUIRE_PEERS=1.
fn peer(path: &str) -> bool {
    let ok = Path::new(path).exists();
    assert!(ok || !require_peers(), "{path} is required (SNAPCTL_REQUIRE_PEERS=1); run scripts/setup.sh");
    if !ok {
        eprintln!("SKIP: {path} not installed");
    }
    ok
}

fn ok(cmd: &mut Command) -> Run {
    let r = run(cmd);
    assert_eq!(r.code, 0, "{cmd:?}: {r:?}");
    r
}

/// Steps of these tests beside [`Work`]'s own: the peers, run in the work area.
trait PeerWork {
    /// cosign with a key pair of its own (empty password), no transparency log, plain HTTP.
    fn cosign(&self, args: &[&str]) -> Run;
    fn oras(&self, args: &[&str]) -> Run;
    fn inspect(&self, reference: &str) -> Value;
    fn verify_sig(&self, image: &str, oci11: bool) -> Run;
}

impl PeerWork for Work {
    fn cosign(&self, args: &[&str]) -> Run {
        run(Command::new(COSIGN)
            .current_dir(self.root())
            .env("COSIGN_PASSWORD", "")
            .env("COSIGN_EXPERIMENTAL", "1")
            .env("DOCKER_CONFIG", self.path("docker"))
            .env("HOME", self.root())
            .args(args))
    }
    fn oras(&self, args: &[&str]) -> Run {
        run(Command::new(ORAS).current_dir(self.root()).env("DOCKER_CONFIG", self.path("docker")).env("HOME", self.root()).args(args))
    }
    fn inspect(&self, reference: &str) -> Value {
        serde_json::from_str(&ok(self.cmd().args(["inspect", reference, "--json"])).stdout).unwrap()
    }
    fn verify_sig(&self, image: &str, oci11: bool) -> Run {
        let mut args = vec!["verify", "--key", "cosign.pub", "--insecure-ignore-tlog", "--allow-http-registry"];
        if oci11 {
            args.push("--experimental-oci11");
        }
        args.push(image);
        self.cosign(&args)
    }
}

fn types(referrers: &Value) -> Vec<String> {
    referrers.as_array().unwrap().iter().map(|r| r["artifactType"].as_str().unwrap_or(r["mediaType"].as_str().unwrap()).to_string()).collect()
}

/// Everything `oras discover` lists for `image`.
fn discovered(w: &Work, image: &str) -> String {
    let r = w.oras(&["discover", "--plain-http", "--format", "json", image]);
    assert_eq!(r.code, 0, "oras discover {image}: {r:?}");
    r.stdout
}

/// Issue 22: `copy` dropped signatures, SBOMs and snapctl's recorded traces (`oras cp -r`
/// carries them). Now they come along to `snapctl serve` (referrers API) and to
/// distribution 2.8 (fallback tag scheme), where `cosign verify` accepts the signature;
/// `--no-referrers` copies the image alone; `inspect` lists them.
#[test]
fn regression_issue_22_copy_carries_signatures_sboms_and_traces_to_snapctl_and_distribution() {
    if !peer(COSIGN) || !peer(ORAS) || !have("docker-registry") {
        return;
    }
    let w = Work::new();
    let a = Serve::start(w.path("a").to_str().unwrap(), &[], &[]);
    let b = Serve::start(w.path("b").to_str().unwrap(), &[], &[]);
    std::fs::create_dir_all(w.path("dist")).unwrap();
    let d = Distribution::start(&w.path("dist"));

    let snap = w.path("snap");
    ok(w.cmd().arg("sample").arg(&snap).args(["--size", "4MiB"]));
    let digest = ok(w.cmd().arg("push").arg(&snap).arg(format!("{}/vm:v1", a.addr))).stdout.trim().to_owned();
    let at_a = format!("{}/vm@{digest}", a.addr);

    // An SBOM (oras), a cosign signature in the tag scheme and one as an OCI 1.1 referrer,
    // and a snapctl trace with its working set, the way `lazy --record` stores one.
    std::fs::write(w.path("sbom.json"), br#"{"spdxVersion":"SPDX-2.3","name":"vm"}"#).unwrap();
    let r = w.oras(&["attach", "--plain-http", "--artifact-type", SBOM_TYPE, &at_a, &format!("sbom.json:{SBOM_TYPE}")]);
    assert_eq!(r.code, 0, "oras attach: {r:?}");
    let r = w.cosign(&["generate-key-pair"]);
    assert_eq!(r.code, 0, "cosign generate-key-pair: {r:?}");
    let r = w.cosign(&["sign", "--key", "cosign.key", "--tlog-upload=false", "--allow-http-registry", "-y", &at_a]);
    assert_eq!(r.code, 0, "cosign sign: {r:?}");
    let r = w.cosign(&["sign", "--key", "cosign.key", "--tlog-upload=false", "--allow-http-registry", "--registry-referrers-mode=oci-1-1", "-y", &at_a]);
    assert_eq!(r.code, 0, "cosign sign (OCI 1.1): {r:?}");
    let src = Arc::new(regclient::RegistrySource::new(&a.addr, "vm", true, None).unwrap());
    let image = imgfmt::Image::open(src.as_ref(), &digest.parse().unwrap()).unwrap();
    let trace = lazy::Trace::new("vm.mem", image.config().chunk_size, vec![3, 0, 2]);
    let working_set = vec![0x5au8; 200_000];
    use lazy::TraceStore as _;
    lazy::RegistryTraces::new(src.clone()).store(&image, &trace, &working_set).unwrap();

    // inspect lists them at the source.
    let listed = w.inspect(&format!("{}/vm:v1", a.addr));
    let mut kinds = types(&listed["referrers"]);
    kinds.sort();
    assert!(kinds.contains(&SBOM_TYPE.to_string()), "{listed}");
    assert!(kinds.contains(&lazy::TRACE_MEDIA_TYPE.to_string()), "{listed}");
    assert!(listed["referrers"].as_array().unwrap().iter().any(|r| r["tag"].as_str() == Some(&format!("sha256-{}.sig", &digest[7..]))), "{listed}");
    assert!(w.verify_sig(&at_a, false).code == 0, "the tag-scheme signature verifies at the source");

    for (dest, oci11_dest) in [(format!("{}/mirror/vm", b.addr), true), (format!("{}/mirror/vm", d.addr), false)] {
        let r = ok(w.cmd().args(["copy", &format!("{}/vm:v1", a.addr), &format!("{dest}:v1"), "--json"]));
        let rep: Value = serde_json::from_str(&r.stdout).unwrap();
        assert!(rep["referrers"].as_array().unwrap().len() >= 4, "{rep}");
        let there = format!("{dest}@{digest}");
        let v = w.verify_sig(&there, false);
        assert_eq!(v.code, 0, "cosign verify at {dest}: {v:?}");
        if oci11_dest {
            let v = w.verify_sig(&there, true);
            assert_eq!(v.code, 0, "cosign verify --experimental-oci11 at {dest}: {v:?}");
        }
        let found = discovered(&w, &there);
        assert!(found.contains(SBOM_TYPE), "oras discover at {dest}: {found}");
        assert!(found.contains(lazy::TRACE_MEDIA_TYPE), "oras discover at {dest}: {found}");
        // The trace's working-set blob came along.
        let listed = w.inspect(&format!("{dest}:v1"));
        assert!(types(&listed["referrers"]).contains(&lazy::TRACE_MEDIA_TYPE.to_string()), "{listed}");
        let host = dest.split('/').next().unwrap();
        let dst = Arc::new(regclient::RegistrySource::new(host, "mirror/vm", true, None).unwrap());
        let loaded = lazy::RegistryTraces::new(dst.clone()).load(&image, image.file("vm.mem").unwrap().0).unwrap().expect("the trace at the destination");
        assert_eq!(loaded.chunks, trace.chunks);
        use imgfmt::BlobSource as _;
        let refs = dst.list_referrers(&image.manifest_digest, Some(lazy::TRACE_MEDIA_TYPE)).unwrap();
        let m = imgfmt::Manifest::decode(&imgfmt::source::read_verified_blob(dst.as_ref(), &refs[0].digest, 1 << 20).unwrap()).unwrap();
        assert_eq!(m.layers.len(), 2, "trace and working set: {m:?}");
        assert_eq!(dst.blob_size(&m.layers[1].digest).unwrap(), working_set.len() as u64, "the working-set blob is at {dest}");
    }

    // --no-referrers: the image alone.
    let r = ok(w.cmd().args(["copy", "--no-referrers", &format!("{}/vm:v1", a.addr), &format!("{}/bare/vm:v1", b.addr)]));
    assert!(!r.stderr.contains("referrer"), "{r:?}");
    assert!(w.inspect(&format!("{}/bare/vm:v1", b.addr))["referrers"].as_array().unwrap().is_empty());
    assert_ne!(w.verify_sig(&format!("{}/bare/vm@{digest}", b.addr), false).code, 0, "no signature without referrers");

    // Into a layout and out again: the layout lists them under the fallback tag.
    let lay = format!("oci:{}:v1", w.path("layout").display());
    ok(w.cmd().args(["copy", &format!("{}/vm:v1", a.addr), &lay]));
    let listed = w.inspect(&lay);
    assert!(listed["referrers"].as_array().unwrap().len() >= 4, "{listed}");
    ok(w.cmd().args(["copy", &lay, &format!("{}/again/vm:v1", b.addr)]));
    assert_eq!(w.verify_sig(&format!("{}/again/vm@{digest}", b.addr), false).code, 0);
    assert!(discovered(&w, &format!("{}/again/vm@{digest}", b.addr)).contains(SBOM_TYPE));
}

/// A wake looks for the image's trace while it reads the image (`TraceStore::prepare`, then
/// `load`): what it finds is what `load` alone finds, and a lookup made for another image
/// is not used for this one (issue 23 §3, wake).
#[test]
fn regression_issue_23_a_trace_looked_up_ahead_is_the_one_load_finds() {
    use lazy::TraceStore as _;
    let w = Work::new();
    let a = Serve::start(w.path("a").to_str().unwrap(), &[], &[]);
    let snap = w.path("snap");
    ok(w.cmd().arg("sample").arg(&snap).args(["--size", "4MiB"]));
    let digest = ok(w.cmd().arg("push").arg(&snap).arg(format!("{}/vm:v1", a.addr))).stdout.trim().to_owned();
    ok(w.cmd().arg("sample").arg(w.path("other")).args(["--size", "4MiB", "--seed", "9"]));
    let other = ok(w.cmd().arg("push").arg(w.path("other")).arg(format!("{}/vm:other", a.addr))).stdout.trim().to_owned();
    let src = Arc::new(regclient::RegistrySource::new(&a.addr, "vm", true, None).unwrap());
    let image = imgfmt::Image::open(src.as_ref(), &digest.parse().unwrap()).unwrap();
    let file = image.file("vm.mem").unwrap().0;
    let fresh = || lazy::RegistryTraces::new(Arc::new(regclient::RegistrySource::new(&a.addr, "vm", true, None).unwrap()));

    // No trace yet: none, prepared or not.
    let t = fresh();
    assert!(!t.prepare(&image.manifest_digest), "the registry listed no trace");
    assert_eq!(t.load(&image, file).unwrap(), None);

    let mut trace = lazy::Trace::new("vm.mem", image.config().chunk_size, vec![3, 0, 2]);
    trace.working_set = vec![0, 4096];
    lazy::RegistryTraces::new(src.clone()).store(&image, &trace, &vec![0x5au8; 8192]).unwrap();
    let plain = fresh().load(&image, file).unwrap().expect("the stored trace");
    assert_eq!((plain.chunks.clone(), plain.working_set.clone()), (trace.chunks.clone(), trace.working_set.clone()));
    assert!(plain.working_set_blob.is_some(), "its working-set blob is there");

    let t = fresh();
    assert!(t.prepare(&image.manifest_digest), "a trace is listed");
    assert_eq!(t.load(&image, file).unwrap().as_ref(), Some(&plain), "prepared, the same trace");
    // Taken by that load: the next one looks again, and still finds it.
    assert_eq!(t.load(&image, file).unwrap().as_ref(), Some(&plain));

    // A lookup for another image (which has no trace) is not this image's answer.
    let t = fresh();
    assert!(!t.prepare(&other.parse().unwrap()));
    assert_eq!(t.load(&image, file).unwrap().as_ref(), Some(&plain));
}
