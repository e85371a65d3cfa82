//! Signatures and policies (issue 24, spec/sign.md): `snapctl sign`, `snapctl key`, and
//! `--policy` in pull, unpack, copy, verify and lazy, against `snapctl serve`, Debian's
//! docker-registry 2.8, and the peers that already speak the format: cosign 2.x
//! (/opt/snapctl-cosign/cosign) and skopeo with sigstore (/opt/snapctl-skopeo/skopeo:
//! Debian bookworm's skopeo 1.9.3 is built with sigstore disabled). Both are installed by
//! scripts/setup.sh --tests; without them the interop tests print a skip note, and with
//! SNAPCTL_REQUIRE_PEERS=1 fail.
//!
//! Every refusal is checked to leave nothing behind: no destination directory, no chunk
//! cache, no copied image, no lazy socket.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine as _;
use snapctl_tests::registry_support::{Distribution, Serve};
use snapctl_tests::{have, require_peers, run, snapctl, uffd_usable, Run};

const COSIGN: &str = "/opt/snapctl-cosign/cosign";
const SKOPEO: &str = "/opt/snapctl-skopeo/skopeo";
const PASSWORD: &str = "interop-pw";

/// Whether a peer at `path` runs; a loud skip, or a failure under SNAPCTL_REQUIRE_PEERS=1.
fn peer(path: &str, version_arg: &str) -> bool {
    let ok = Command::new(path).arg(version_arg).stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success());
    assert!(ok || !require_peers(), "{path} is required (SNAPCTL_REQUIRE_PEERS=1); run scripts/setup.sh --tests");
    if !ok {
        eprintln!("SKIP: {path} is not installed (scripts/setup.sh --tests installs it)");
    }
    ok
}

fn cosign_available() -> bool {
    peer(COSIGN, "version")
}

fn skopeo_available() -> bool {
    peer(SKOPEO, "--version")
}

fn ok(r: &Run) -> &Run {
    assert_eq!(r.code, 0, "{r:?}");
    r
}

/// A scratch directory, a `snapctl serve`, and a small snapshot.
struct World {
    dir: tempfile::TempDir,
    serve: Serve,
}

impl World {
    fn new() -> World {
        let dir = tempfile::tempdir().unwrap();
        let serve = Serve::start(dir.path().join("store").to_str().unwrap(), &[], &[]);
        let w = World { dir, serve };
        ok(&w.sn(&["sample", w.path("snap").to_str().unwrap(), "--size", "4MiB"]));
        w
    }

    fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    fn s(&self, p: &str) -> String {
        self.path(p).to_string_lossy().into_owned()
    }

    /// snapctl with the key password set.
    fn sn(&self, args: &[&str]) -> Run {
        run(snapctl().args(args).env("COSIGN_PASSWORD", PASSWORD).env("HOME", self.dir.path()).current_dir(self.dir.path()))
    }

    /// `REPO:TAG` on the server.
    fn r(&self, repo_tag: &str) -> String {
        format!("{}/{repo_tag}", self.serve.addr)
    }

    /// Push the sample snapshot (or `dir`) to `repo_tag`; its manifest digest.
    fn push_dir(&self, dir: &str, repo_tag: &str) -> String {
        let r = ok(&self.sn(&["push", &self.s(dir), &self.r(repo_tag), "--json"])).stdout.clone();
        let v: serde_json::Value = serde_json::from_str(&r).unwrap();
        v["manifest"].as_str().unwrap().to_string()
    }

    fn push(&self, repo_tag: &str) -> String {
        self.push_dir("snap", repo_tag)
    }

    /// `snapctl key generate` → (PREFIX.key, PREFIX.pub).
    fn key(&self, prefix: &str) -> (String, String) {
        ok(&self.sn(&["key", "generate", "--output-key-prefix", &self.s(prefix)]));
        (self.s(&format!("{prefix}.key")), self.s(&format!("{prefix}.pub")))
    }

    /// A policy file: every docker image under `scope` must be signed by `pubkey`, with
    /// `identity` as signedIdentity (None: the default); everything else rejected.
    fn policy(&self, name: &str, scope: &str, pubkey: &str, identity: Option<&str>) -> String {
        let si = identity.map(|t| format!(r#","signedIdentity":{{"type":"{t}"}}"#)).unwrap_or_default();
        let text = format!(
            r#"{{"default":[{{"type":"reject"}}],"transports":{{"docker":{{"{scope}":[{{"type":"sigstoreSigned","keyPath":"{pubkey}"{si}}}]}},"oci":{{"":[{{"type":"insecureAcceptAnything"}}]}}}}}}"#
        );
        std::fs::write(self.path(name), text).unwrap();
        self.s(name)
    }

    /// A registry client for `repo` on the server (to plant and tamper).
    fn client(&self, repo: &str) -> regclient::RegistrySource {
        regclient::RegistrySource::new(&self.serve.addr, repo, true, None).unwrap()
    }
}

fn sig_tag(digest: &str) -> String {
    format!("{}.sig", digest.replace(':', "-"))
}

/// `cosign verify --key PUB` of `image` (plain HTTP, no transparency log).
fn cosign_verify(pubkey: &str, image: &str, extra: &[&str]) -> Run {
    run(Command::new(COSIGN).args(["verify", "--key", pubkey, "--insecure-ignore-tlog", "--allow-http-registry"]).args(extra).arg(image))
}

/// `skopeo copy --policy POLICY docker://IMAGE oci:DEST:t`, reading sigstore attachments.
fn skopeo_copy(w: &World, policy: &str, image: &str, dest: &str) -> Run {
    let regd = w.path("registries.d");
    std::fs::create_dir_all(&regd).unwrap();
    std::fs::write(regd.join("snapctl.yaml"), format!("docker:\n  {}:\n    use-sigstore-attachments: true\n", w.serve.addr)).unwrap();
    run(Command::new(SKOPEO).args(["copy", "--remove-signatures", "--policy", policy, "--registries.d"]).arg(&regd).args([
        "--src-tls-verify=false",
        &format!("docker://{image}"),
        &format!("oci:{dest}:t"),
    ]))
}

/// Pull `image` under `policy` into a fresh directory with its own cache: the refusal's
/// message, after checking nothing was written or cached.
fn pull_refused(w: &World, image: &str, policy: &str, want: &str) -> String {
    let (dest, cache) = (w.path("refused-dest"), w.path("refused-cache"));
    let r = w.sn(&["pull", image, dest.to_str().unwrap(), "--cache", cache.to_str().unwrap(), "--policy", policy]);
    assert_eq!(r.code, 1, "pull must be refused with exit 1: {r:?}");
    assert!(r.stderr.contains(want) && r.stderr.contains("refused"), "the message names why ({want}): {}", r.stderr);
    assert!(!dest.exists(), "a refused pull wrote {}", dest.display());
    assert!(!cache.exists(), "a refused pull created its cache");
    r.stderr
}

fn pull_accepted(w: &World, image: &str, policy: &str) -> Run {
    let dest = w.path("accepted-dest");
    let _ = std::fs::remove_dir_all(&dest);
    let r = w.sn(&["pull", image, dest.to_str().unwrap(), "--no-cache", "--policy", policy]);
    assert_eq!(r.code, 0, "{r:?}");
    assert!(r.stderr.contains("signature: ") && r.stderr.contains("signed by key sha256:"), "{}", r.stderr);
    assert_eq!(std::fs::read(dest.join("vm.mem")).unwrap(), std::fs::read(w.path("snap/vm.mem")).unwrap());
    r
}

/// snapctl's key and signature, checked by cosign; cosign signs with snapctl's key.
#[test]
fn snapctl_signs_and_cosign_verifies_and_uses_snapctls_key() {
    if !cosign_available() {
        return;
    }
    let w = World::new();
    let (key, public) = w.key("cosign");
    let fp = ok(&w.sn(&["key", "fingerprint", &public])).stdout.trim().to_string();
    assert_eq!(ok(&w.sn(&["key", "fingerprint", &key])).stdout.trim(), fp, "the private key names the same signer");
    let digest = w.push("vm/web:v1");
    let image = w.r("vm/web:v1");
    assert!(cosign_verify(&public, &image, &[]).code != 0, "unsigned: cosign refuses");
    let r = ok(&w.sn(&["sign", &image, "--key", &key, "--json"])).stdout.clone();
    let rep: serde_json::Value = serde_json::from_str(&r).unwrap();
    assert_eq!(rep["key"], fp.as_str());
    assert_eq!(rep["tag"], sig_tag(&digest));
    assert!(rep["referrer"].is_string(), "snapctl serve has the referrers API: {rep}");
    // Tag scheme, then the referrer alone (cosign's OCI 1.1 mode).
    let v = ok(&cosign_verify(&public, &image, &[])).stdout.clone();
    assert!(v.contains(&digest) && v.contains(&format!("\"docker-reference\":\"{image}\"")), "{v}");
    ok(&cosign_verify(&public, &image, &["--experimental-oci11"]));
    // cosign reads snapctl's key file and appends its signature beside snapctl's.
    let s =
        run(Command::new(COSIGN).env("COSIGN_PASSWORD", PASSWORD).args(["sign", "--key", &key, "--tlog-upload=false", "--allow-http-registry", "-y", &image]));
    ok(&s);
    let m = w.client("vm/web").get_manifest(&sig_tag(&digest), 1 << 20).unwrap().unwrap();
    let m: serde_json::Value = serde_json::from_slice(&m).unwrap();
    assert_eq!(m["layers"].as_array().unwrap().len(), 2, "cosign appended: {m}");
    // Signing again with the same key writes nothing new.
    let again: serde_json::Value = serde_json::from_str(&ok(&w.sn(&["sign", &image, "--key", &key, "--json"])).stdout).unwrap();
    assert_eq!(again["already_signed"], true);
    assert_eq!(again["tag_signatures"], 2);
    // inspect names both, and who signed.
    let i = ok(&w.sn(&["inspect", &image, "--key", &public])).stdout.clone();
    assert_eq!(i.matches(&format!("signed by key {fp}")).count(), 3, "tag layers 0 and 1, and the referrer: {i}");
    let i = ok(&w.sn(&["inspect", &image])).stdout.clone();
    assert!(i.contains("by a key not given"), "{i}");
}

/// cosign's own key pair and signatures (tag scheme and OCI 1.1 referrers) pass snapctl's
/// policy; its repository-only identity needs matchRepository, as with containers/image.
#[test]
fn cosign_signs_and_snapctl_accepts() {
    if !cosign_available() {
        return;
    }
    let w = World::new();
    let g = run(Command::new(COSIGN).env("COSIGN_PASSWORD", PASSWORD).current_dir(w.dir.path()).args(["generate-key-pair"]));
    ok(&g);
    let (key, public) = (w.s("cosign.key"), w.s("cosign.pub"));
    w.push("vm/tag:v1");
    w.push("vm/oci11:v1");
    ok(&run(Command::new(COSIGN).env("COSIGN_PASSWORD", PASSWORD).args([
        "sign",
        "--key",
        &key,
        "--tlog-upload=false",
        "--allow-http-registry",
        "-y",
        &w.r("vm/tag:v1"),
    ])));
    ok(&run(Command::new(COSIGN).env("COSIGN_PASSWORD", PASSWORD).env("COSIGN_EXPERIMENTAL", "1").args([
        "sign",
        "--key",
        &key,
        "--tlog-upload=false",
        "--allow-http-registry",
        "--registry-referrers-mode=oci-1-1",
        "-y",
        &w.r("vm/oci11:v1"),
    ])));
    let repo = w.policy("repo.json", &format!("{}/vm", w.serve.addr), &public, Some("matchRepository"));
    pull_accepted(&w, &w.r("vm/tag:v1"), &repo);
    let r = pull_accepted(&w, &w.r("vm/oci11:v1"), &repo);
    assert!(r.stderr.contains("(referrer sha256:"), "found through the referrers API: {}", r.stderr);
    // The default signedIdentity never accepts a repository-only identity.
    let exact = w.policy("exact.json", &format!("{}/vm", w.serve.addr), &public, None);
    pull_refused(&w, &w.r("vm/tag:v1"), &exact, "signedIdentity matchRepoDigestOrExact does not accept");
}

/// skopeo (sigstore) both ways: it accepts snapctl's signature under a sigstoreSigned
/// policy, and snapctl accepts skopeo's.
#[test]
fn skopeo_and_snapctl_accept_each_others_signatures() {
    if !skopeo_available() {
        return;
    }
    let w = World::new();
    let (key, public) = w.key("k");
    w.push("vm/web:v1");
    ok(&w.sn(&["sign", &w.r("vm/web:v1"), "--key", &key]));
    let policy = w.policy("policy.json", &format!("{}/vm", w.serve.addr), &public, None);
    ok(&skopeo_copy(&w, &policy, &w.r("vm/web:v1"), &w.s("skopeo-out")));
    // skopeo signs a copy into the registry with the same key (written by snapctl).
    ok(&w.sn(&["pack", &w.s("snap"), &format!("oci:{}:v1", w.s("lay"))]));
    std::fs::write(w.path("pw"), PASSWORD).unwrap();
    let regd = w.path("registries.d");
    let s = run(Command::new(SKOPEO)
        .args(["copy", "--policy", &policy, "--registries.d"])
        .arg(&regd)
        .args(["--dest-tls-verify=false", "--sign-by-sigstore-private-key", &key, "--sign-passphrase-file", &w.s("pw")])
        .arg(format!("oci:{}:v1", w.s("lay")))
        .arg(format!("docker://{}", w.r("vm/skopeo:v1"))));
    ok(&s);
    let r = pull_accepted(&w, &w.r("vm/skopeo:v1"), &policy);
    assert!(r.stderr.contains(&format!("as {}", w.r("vm/skopeo:v1"))), "skopeo certifies the tag: {}", r.stderr);
}

/// Tampered payload, a signature for another digest, and a wrong key: snapctl, cosign and
/// skopeo all refuse.
#[test]
fn tampering_another_digest_and_a_wrong_key_are_refused_by_all_three() {
    let (have_cosign, have_skopeo) = (cosign_available(), skopeo_available());
    let w = World::new();
    let (key, public) = w.key("k");
    let (_, wrong) = w.key("wrong");
    let scope = format!("{}/vm", w.serve.addr);
    let policy = w.policy("policy.json", &scope, &public, None);
    let wrong_policy = w.policy("wrong.json", &scope, &wrong, None);
    let good = w.push("vm/web:v1");
    ok(&w.sn(&["sign", &w.r("vm/web:v1"), "--key", &key, "--no-referrer"]));
    pull_accepted(&w, &w.r("vm/web:v1"), &policy);

    // A wrong key.
    pull_refused(&w, &w.r("vm/web:v1"), &wrong_policy, "does not verify with key");
    if have_cosign {
        assert_ne!(cosign_verify(&wrong, &w.r("vm/web:v1"), &[]).code, 0);
    }
    if have_skopeo {
        assert_ne!(skopeo_copy(&w, &wrong_policy, &w.r("vm/web:v1"), &w.s("s1")).code, 0);
    }

    // A signature for another digest: the signed image's .sig manifest under another
    // image's tag (another snapshot in the same repository, tagged v1 there).
    ok(&w.sn(&["sample", &w.s("snap2"), "--size", "4MiB", "--seed", "3"]));
    let c = w.client("vm/web");
    let other = w.push_dir("snap2", "vm/other:v1");
    let sig = c.get_manifest(&sig_tag(&good), 1 << 20).unwrap().unwrap();
    let oc = w.client("vm/other");
    for l in serde_json::from_slice::<serde_json::Value>(&sig).unwrap()["layers"]
        .as_array()
        .unwrap()
        .iter()
        .chain([&serde_json::from_slice::<serde_json::Value>(&sig).unwrap()["config"]])
    {
        let d: imgfmt::OciDigest = l["digest"].as_str().unwrap().parse().unwrap();
        oc.push_small_blob(&imgfmt::BlobSource::read_blob_unverified(&c, &d, 1 << 20).unwrap()).unwrap();
    }
    oc.put_manifest(&sig_tag(&other), &sig).unwrap();
    let other_policy = w.policy("other.json", &scope, &public, Some("matchRepository"));
    pull_refused(&w, &w.r("vm/other:v1"), &other_policy, "it signs another manifest");
    if have_cosign {
        let r = cosign_verify(&public, &w.r("vm/other:v1"), &[]);
        assert_ne!(r.code, 0, "{r:?}");
    }
    if have_skopeo {
        assert_ne!(skopeo_copy(&w, &other_policy, &w.r("vm/other:v1"), &w.s("s2")).code, 0);
    }

    // A tampered payload: rewritten to name another digest (the other image's), its layer
    // descriptor updated to the new bytes.
    let mut m: serde_json::Value = serde_json::from_slice(&sig).unwrap();
    let d: imgfmt::OciDigest = m["layers"][0]["digest"].as_str().unwrap().parse().unwrap();
    let payload = String::from_utf8(imgfmt::BlobSource::read_blob_unverified(&c, &d, 1 << 20).unwrap()).unwrap().replace(&good, &other);
    let nd = oc.push_small_blob(payload.as_bytes()).unwrap();
    m["layers"][0]["digest"] = nd.to_string().into();
    m["layers"][0]["size"] = payload.len().into();
    oc.put_manifest(&sig_tag(&other), &serde_json::to_vec(&m).unwrap()).unwrap();
    pull_refused(&w, &w.r("vm/other:v1"), &other_policy, "does not verify");
    if have_cosign {
        assert_ne!(cosign_verify(&public, &w.r("vm/other:v1"), &[]).code, 0);
    }
    if have_skopeo {
        assert_ne!(skopeo_copy(&w, &other_policy, &w.r("vm/other:v1"), &w.s("s3")).code, 0);
    }
}

/// Every refusal, in every command that restores, writes nothing: no signature, another
/// repository's name, a tampered signature, and a signature manifest that is malformed,
/// has too many layers, or is too large.
#[test]
fn every_refusal_writes_nothing_in_any_command() {
    let w = World::new();
    let (key, public) = w.key("k");
    let policy = w.policy("policy.json", &format!("{}/vm", w.serve.addr), &public, Some("matchRepository"));
    // Unsigned.
    let unsigned = w.push("vm/unsigned:v1");
    pull_refused(&w, &w.r("vm/unsigned:v1"), &policy, "no signature (no tag sha256-");
    // Signed under another repository's name.
    w.push("vm/named:v1");
    ok(&w.sn(&["sign", &w.r("vm/named:v1"), "--key", &key, "--identity", &w.r("vm/elsewhere:v1")]));
    pull_refused(&w, &w.r("vm/named:v1"), &policy, "signedIdentity matchRepository does not accept");
    // A signature with a bit flipped.
    let digest = w.push("vm/flipped:v1");
    ok(&w.sn(&["sign", &w.r("vm/flipped:v1"), "--key", &key, "--no-referrer"]));
    let c = w.client("vm/flipped");
    let mut m: serde_json::Value = serde_json::from_slice(&c.get_manifest(&sig_tag(&digest), 1 << 20).unwrap().unwrap()).unwrap();
    let b64 = m["layers"][0]["annotations"]["dev.cosignproject.cosign/signature"].as_str().unwrap().to_string();
    let mut raw = base64::engine::general_purpose::STANDARD.decode(b64).unwrap();
    let n = raw.len();
    raw[n - 3] ^= 0x10;
    m["layers"][0]["annotations"]["dev.cosignproject.cosign/signature"] = base64::engine::general_purpose::STANDARD.encode(raw).into();
    c.put_manifest(&sig_tag(&digest), &serde_json::to_vec(&m).unwrap()).unwrap();
    pull_refused(&w, &w.r("vm/flipped:v1"), &policy, "does not verify");
    // Malformed, too many layers, too large: planted at the tag.
    let digest = w.push("vm/bad:v1");
    let c = w.client("vm/bad");
    let payload = c.push_small_blob(b"{}").unwrap();
    let layer = serde_json::json!({"mediaType": "application/vnd.dev.cosign.simplesigning.v1+json", "digest": payload.to_string(), "size": 2, "annotations": {"dev.cosignproject.cosign/signature": "AAAA"}});
    let manifest = |layers: Vec<serde_json::Value>| {
        serde_json::to_vec(&serde_json::json!({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": payload.to_string(), "size": 2}, "layers": layers}))
        .unwrap()
    };
    let mut wrong_size = layer.clone();
    wrong_size["size"] = (1u64 << 30).into();
    let mut huge = layer.clone();
    huge["annotations"]["x"] = "a".repeat(300 << 10).into();
    for (body, want) in [
        (manifest(vec![wrong_size]), "claims 1073741824 bytes"),
        (manifest(vec![layer.clone(); 65]), "65 layers, more than 64"),
        (manifest(vec![huge]), "limit"),
    ] {
        c.put_manifest(&sig_tag(&digest), &body).unwrap();
        let msg = pull_refused(&w, &w.r("vm/bad:v1"), &policy, want);
        assert!(msg.contains("malformed signature storage"), "{msg}");
    }

    // unpack, copy (to a layout and to a registry), pull into a layout, verify: unsigned.
    let image = w.r("vm/unsigned:v1");
    let dest = w.path("unpacked");
    let r = w.sn(&["unpack", &image, dest.to_str().unwrap(), "--policy", &policy]);
    assert_eq!(r.code, 1, "{r:?}");
    assert!(!dest.exists());
    for to in [format!("oci:{}:v1", w.s("copied")), w.r("vm/copied:v1")] {
        for cmd in ["copy", "pull"] {
            let r = w.sn(&[cmd, &image, &to, "--policy", &policy]);
            assert_eq!(r.code, 1, "{cmd} → {to}: {r:?}");
            assert!(r.stderr.contains("refused"), "{}", r.stderr);
        }
    }
    assert!(!w.path("copied").exists(), "a refused copy created the layout");
    assert!(!w.client("vm/copied").manifest_exists(&unsigned.parse().unwrap()).unwrap(), "nothing was copied to the registry");
    let r = w.sn(&["verify", &image, "--policy", &policy]);
    assert_eq!(r.code, 1, "{r:?}");
    assert!(r.stderr.contains("no signature"), "{}", r.stderr);
    // What is not signed passes with no policy at all, as before (HOME has none; the
    // system's may): --insecure-policy, and a policy that accepts anything.
    let anything = w.path("anything.json");
    std::fs::write(&anything, r#"{"default":[{"type":"insecureAcceptAnything"}]}"#).unwrap();
    ok(&w.sn(&["verify", &image, "--insecure-policy"]));
    ok(&w.sn(&["verify", &image, "--policy", anything.to_str().unwrap()]));
    // A policy that rejects names the rule; an invalid one is an error (2), not a pass.
    let reject = w.path("reject.json");
    std::fs::write(&reject, r#"{"default":[{"type":"reject"}]}"#).unwrap();
    let r = w.sn(&["verify", &image, "--policy", reject.to_str().unwrap()]);
    assert!(r.code == 1 && r.stderr.contains("default (requirement 0: reject)"), "{r:?}");
    std::fs::write(&reject, r#"{"default":[{"type":"reject","keyPath":"/x"}]}"#).unwrap();
    let r = w.sn(&["verify", &image, "--policy", reject.to_str().unwrap()]);
    assert!(r.code == 2 && r.stderr.contains("unknown field"), "{r:?}");
    // The policy is found where containers tools look: $HOME/.config/containers/policy.json.
    std::fs::create_dir_all(w.path(".config/containers")).unwrap();
    std::fs::copy(&policy, w.path(".config/containers/policy.json")).unwrap();
    let r = w.sn(&["verify", &image]);
    assert!(r.code == 1 && r.stderr.contains(".config/containers/policy.json"), "{r:?}");
}

/// Layouts: `snapctl sign oci:…` with the name to certify, a policy scope on the layout's
/// directory, and a layer whose parent is swapped for another: refused, since the
/// signature names the manifest, which names the parent's config by digest.
#[test]
fn swapped_parent_is_refused() {
    let w = World::new();
    let (key, public) = w.key("k");
    let lay = w.s("images");
    ok(&w.sn(&["sample", &w.s("other-base"), "--size", "4MiB", "--seed", "5"]));
    ok(&w.sn(&["pack", &w.s("snap"), &format!("oci:{lay}:base")]));
    ok(&w.sn(&["pack", &w.s("other-base"), &format!("oci:{lay}:other-base")]));
    ok(&w.sn(&["sample", &w.s("snap"), "--size", "4MiB", "--mutate", "2"]));
    ok(&w.sn(&["pack", &w.s("snap"), &format!("oci:{lay}:top"), "--parent", &format!("oci:{lay}:base")]));
    let r = w.sn(&["sign", &format!("oci:{lay}:top"), "--key", &key]);
    assert!(r.code == 2 && r.stderr.contains("--identity"), "a layout needs the name to certify: {r:?}");
    ok(&w.sn(&["sign", &format!("oci:{lay}:top"), "--key", &key, "--identity", "registry.example.com/vm/web:top"]));
    let canon = std::fs::canonicalize(&lay).unwrap();
    let policy = w.path("layout-policy.json");
    std::fs::write(
        &policy,
        format!(
            r#"{{"default":[{{"type":"reject"}}],"transports":{{"oci":{{"{}":[{{"type":"sigstoreSigned","keyPath":"{public}","signedIdentity":{{"type":"exactRepository","dockerRepository":"registry.example.com/vm/web"}}}}]}}}}}}"#,
            canon.display()
        ),
    )
    .unwrap();
    let policy = policy.to_str().unwrap();
    let dest = w.path("restored");
    ok(&w.sn(&["unpack", &format!("oci:{lay}:top"), dest.to_str().unwrap(), "--policy", policy]));
    std::fs::remove_dir_all(&dest).unwrap();
    // The default signedIdentity cannot accept a layout (it has no registry name).
    let dflt = w.path("dflt.json");
    std::fs::write(&dflt, format!(r#"{{"default":[{{"type":"sigstoreSigned","keyPath":"{public}"}}]}}"#)).unwrap();
    let r = w.sn(&["unpack", &format!("oci:{lay}:top"), dest.to_str().unwrap(), "--policy", dflt.to_str().unwrap()]);
    assert!(r.code == 1 && r.stderr.contains("a layout"), "{r:?}");
    assert!(!dest.exists());

    // The same layer packed over the other parent, under the signed tag.
    let layout = imgfmt::OciLayout::open(&lay).unwrap();
    let signed = imgfmt::BlobSource::resolve_tag(&layout, "top").unwrap();
    ok(&w.sn(&["pack", &w.s("snap"), &format!("oci:{lay}:top"), "--parent", &format!("oci:{lay}:other-base")]));
    let swapped = imgfmt::BlobSource::resolve_tag(&layout, "top").unwrap();
    assert_ne!(signed, swapped, "another parent, another manifest");
    let r = w.sn(&["unpack", &format!("oci:{lay}:top"), dest.to_str().unwrap(), "--policy", policy]);
    assert!(r.code == 1 && r.stderr.contains("no signature"), "{r:?}");
    assert!(!dest.exists());
    // Its signature tag given the signed layer's signature manifest: it names the other digest.
    let sigd = imgfmt::BlobSource::resolve_tag(&layout, &sig_tag(signed.as_str())).unwrap();
    let size = imgfmt::BlobSource::blob_size(&layout, &sigd).unwrap();
    layout.set_tag(&sig_tag(swapped.as_str()), imgfmt::Descriptor::new(imgfmt::media::OCI_MANIFEST, sigd, size)).unwrap();
    let r = w.sn(&["unpack", &format!("oci:{lay}:top"), dest.to_str().unwrap(), "--policy", policy]);
    assert!(r.code == 1 && r.stderr.contains("it signs another manifest"), "{r:?}");
    assert!(!dest.exists());
    // By the signed digest, it is still accepted.
    ok(&w.sn(&["unpack", &format!("oci:{lay}@{signed}"), dest.to_str().unwrap(), "--policy", policy]));
}

/// Debian's docker-registry has no referrers API: snapctl signs in the tag scheme only;
/// cosign and snapctl accept it; cosign's OCI 1.1 signature (kept in the fallback tag)
/// is found by snapctl.
#[test]
fn docker_registry_gets_the_tag_scheme_and_the_fallback_tag_is_read() {
    if !have("docker-registry") || !cosign_available() {
        return;
    }
    let w = World::new();
    let dist = Distribution::start(w.dir.path());
    let (key, public) = w.key("k");
    let image = format!("{}/vm/web:v1", dist.addr);
    w.push("vm/src:v1");
    ok(&w.sn(&["copy", &w.r("vm/src:v1"), &image]));
    let r: serde_json::Value = serde_json::from_str(&ok(&w.sn(&["sign", &image, "--key", &key, "--json"])).stdout).unwrap();
    assert!(r["referrer"].is_null(), "no referrers API, no referrer: {r}");
    ok(&cosign_verify(&public, &image, &[]));
    let policy = w.policy("policy.json", &format!("{}/vm", dist.addr), &public, None);
    let dest = w.path("from-dist");
    ok(&w.sn(&["pull", &image, dest.to_str().unwrap(), "--no-cache", "--policy", &policy]));
    // cosign in OCI 1.1 mode on a registry without the API.
    let image2 = format!("{}/vm/oci11:v1", dist.addr);
    ok(&w.sn(&["copy", &w.r("vm/src:v1"), &image2]));
    ok(&run(Command::new(COSIGN).env("COSIGN_PASSWORD", PASSWORD).env("COSIGN_EXPERIMENTAL", "1").args([
        "sign",
        "--key",
        &key,
        "--tlog-upload=false",
        "--allow-http-registry",
        "--registry-referrers-mode=oci-1-1",
        "-y",
        &image2,
    ])));
    let repo = w.policy("repo.json", &format!("{}/vm", dist.addr), &public, Some("matchRepository"));
    let dest = w.path("from-dist-2");
    let r = w.sn(&["pull", &image2, dest.to_str().unwrap(), "--no-cache", "--policy", &repo]);
    ok(&r);
    assert!(r.stderr.contains("(referrer sha256:"), "{}", r.stderr);
}

/// `lazy` decides before its socket exists: a refused image never gets a runtime's
/// handshake; an accepted one is served (fake_vmm restores it, every page checked).
#[test]
fn lazy_refuses_before_listening_and_serves_a_signed_image() {
    let w = World::new();
    let (key, public) = w.key("k");
    let policy = w.policy("policy.json", &format!("{}/vm", w.serve.addr), &public, None);
    w.push("vm/web:v1");
    let socket = w.path("uffd.sock");
    let t0 = Instant::now();
    let r = w.sn(&["lazy", &w.r("vm/web:v1"), "--socket", socket.to_str().unwrap(), "--no-cache", "--once", "--policy", &policy]);
    assert_eq!(r.code, 1, "{r:?}");
    assert!(r.stderr.contains("no signature") && !r.stderr.contains("listening"), "{}", r.stderr);
    assert!(!socket.exists(), "a refused lazy restore created its socket");
    assert!(t0.elapsed() < Duration::from_secs(30));
    if !uffd_usable() {
        return;
    }
    ok(&w.sn(&["sign", &w.r("vm/web:v1"), "--key", &key]));
    let log = std::fs::File::create(w.path("lazy.log")).unwrap();
    let mut child = snapctl()
        .args(["lazy", &w.r("vm/web:v1"), "--socket", socket.to_str().unwrap(), "--no-cache", "--once", "--policy", &policy])
        .env("HOME", w.dir.path())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !socket.exists() {
        assert!(
            Instant::now() < deadline && child.try_wait().unwrap().is_none(),
            "lazy did not listen: {}",
            std::fs::read_to_string(w.path("lazy.log")).unwrap()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let vmm = run(Command::new(env!("CARGO_BIN_EXE_fake_vmm")).arg("--socket").arg(&socket).arg("--mem-file").arg(w.path("snap/vm.mem")).args([
        "--json",
        "--timeout",
        "60",
    ]));
    assert_eq!(vmm.code, 0, "{vmm:?}");
    let st = child.wait().unwrap();
    let log = std::fs::read_to_string(w.path("lazy.log")).unwrap();
    assert!(st.success(), "{log}");
    assert!(log.contains("signature: ") && log.contains("signed by key"), "{log}");
}

/// A policy given but missing, and `--policy` with `--insecure-policy`, are errors.
#[test]
fn a_policy_named_but_missing_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let (snap, lay) = (dir.path().join("snap"), format!("oci:{}:v1", dir.path().join("lay").display()));
    ok(&run(snapctl().arg("sample").arg(&snap).args(["--size", "1MiB"])));
    ok(&run(snapctl().arg("pack").arg(&snap).arg(&lay)));
    ok(&run(snapctl().args(["verify", &lay, "--insecure-policy"])));
    let r = run(snapctl().args(["verify", &lay, "--policy"]).arg(dir.path().join("nope.json")));
    assert!(r.code == 2 && r.stderr.contains("nope.json"), "{r:?}");
    let r = run(snapctl().args(["verify", &lay, "--policy", "/x", "--insecure-policy"]));
    assert_eq!(r.code, 2, "{r:?}");
}

/// The default policy fails closed: with no `--policy`, a `$HOME/.config/containers/policy.json`
/// that is there but cannot be looked at is an error (exit 2, naming the file and what to
/// do), never "no policy, accept everything". The cases are the ones that hold for root
/// too (tests run as root, who may search any directory; a user's unsearchable directory
/// is the same stat error path): a dangling symlink (the reject-everything policy it
/// points at was moved away), a path component that is a regular file (ENOTDIR), and a
/// symlink loop (ELOOP). The home candidate comes before `/etc`'s, so the machine's own
/// `/etc/containers/policy.json` plays no part.
#[test]
fn regression_issue_35_an_unreadable_default_policy_refuses_instead_of_accepting() {
    let dir = tempfile::tempdir().unwrap();
    let home = dir.path().join("home");
    let (snap, lay) = (dir.path().join("snap"), format!("oci:{}:v1", dir.path().join("lay").display()));
    ok(&run(snapctl().arg("sample").arg(&snap).args(["--size", "1MiB"])));
    ok(&run(snapctl().arg("pack").arg(&snap).arg(&lay)));
    let containers = home.join(".config/containers");
    let user_policy = containers.join("policy.json");
    let unpack = |what: &str| {
        let dest = dir.path().join(format!("dest-{what}"));
        let r = run(snapctl().arg("unpack").arg(&lay).arg(&dest).env("HOME", &home).env_remove("SNAPCTL_POLICY"));
        assert!(!dest.exists(), "{what}: unpack wrote {} before refusing", dest.display());
        r
    };
    // What the link means to point at: a policy that rejects everything (refused, exit 1).
    let shared = dir.path().join("shared");
    std::fs::create_dir_all(&shared).unwrap();
    std::fs::write(shared.join("policy.json"), r#"{"default":[{"type":"reject"}]}"#).unwrap();
    std::fs::create_dir_all(&containers).unwrap();
    std::os::unix::fs::symlink(shared.join("policy.json"), &user_policy).unwrap();
    let r = unpack("linked");
    assert!(r.code == 1 && r.stderr.contains("reject"), "{r:?}");
    // The policy moved away: the link dangles.
    std::fs::rename(&shared, dir.path().join("shared-moved")).unwrap();
    let r = unpack("dangling");
    assert!(r.code == 2 && r.stderr.contains(".config/containers/policy.json") && r.stderr.contains("does not exist"), "{r:?}");
    assert!(r.stderr.contains("--policy"), "the error says what to do: {}", r.stderr);
    // A symlink loop.
    std::fs::remove_file(&user_policy).unwrap();
    std::os::unix::fs::symlink(&user_policy, &user_policy).unwrap();
    let r = unpack("loop");
    assert!(r.code == 2 && r.stderr.contains(".config/containers/policy.json") && r.stderr.contains("cannot be read"), "{r:?}");
    // A path component that is not a directory.
    std::fs::remove_dir_all(&containers).unwrap();
    std::fs::write(&containers, b"not a directory").unwrap();
    let r = unpack("notdir");
    assert!(r.code == 2 && r.stderr.contains(".config/containers/policy.json") && r.stderr.contains("cannot be read"), "{r:?}");
    // --insecure-policy still consults nothing.
    let dest = dir.path().join("dest-insecure");
    ok(&run(snapctl().arg("unpack").arg(&lay).arg(&dest).arg("--insecure-policy").env("HOME", &home)));
}

/// `copy` adds the source's signatures to those the destination's `sha256-<hex>.sig`
/// already holds (the merge `snapctl sign` uses), each once, instead of replacing the tag:
/// the destination's own signer keeps its signature, so a destination policy requiring it
/// still accepts the image, and cosign verifies every signer's key there. Signed in the
/// tag scheme only (`--no-referrer`), so the tag is the only place a signature can be.
#[test]
fn regression_issue_35_copy_keeps_the_destinations_signatures() {
    let w = World::new();
    let (ka, pa) = w.key("a");
    let (kb, pb) = w.key("b");
    let (kc, pc) = w.key("c");
    let digest = w.push("vm/src:v1");
    let (src, dest) = (w.r("vm/src:v1"), w.r("vm/dest:v1"));
    let layers = |repo: &str| -> usize {
        let m = w.client(repo).get_manifest(&sig_tag(&digest), 1 << 20).unwrap().expect("a signature tag");
        serde_json::from_slice::<serde_json::Value>(&m).unwrap()["layers"].as_array().unwrap().len()
    };
    ok(&w.sn(&["sign", &src, "--key", &ka, "--no-referrer"]));
    ok(&w.sn(&["copy", &src, &dest]));
    // The destination's own signer.
    ok(&w.sn(&["sign", &dest, "--key", &kb, "--no-referrer"]));
    assert_eq!(layers("vm/dest"), 2);
    let policy = w.policy("dest.json", &format!("{}/vm/dest", w.serve.addr), &pb, None);
    ok(&w.sn(&["verify", &dest, "--policy", &policy]));
    // Copied again: nothing new from the source, nothing lost at the destination.
    ok(&w.sn(&["copy", &src, &dest]));
    assert_eq!(layers("vm/dest"), 2, "the copy replaced the destination's signatures");
    ok(&w.sn(&["verify", &dest, "--policy", &policy]));
    // The source gains a signer: the copy brings it beside the two already there.
    ok(&w.sn(&["sign", &src, "--key", &kc, "--no-referrer"]));
    ok(&w.sn(&["copy", &src, &dest]));
    assert_eq!(layers("vm/dest"), 3);
    ok(&w.sn(&["verify", &dest, "--policy", &policy]));
    if cosign_available() {
        for public in [&pa, &pb, &pc] {
            ok(&cosign_verify(public, &dest, &[]));
        }
    }
    // A layout destination the same way.
    let lay = format!("oci:{}:v1", w.s("lay"));
    ok(&w.sn(&["copy", &src, &lay]));
    ok(&w.sn(&["sign", &lay, "--key", &kb, "--identity", "registry.example.com/vm/dest:v1"]));
    ok(&w.sn(&["copy", &src, &lay]));
    let layout = imgfmt::OciLayout::open(w.path("lay")).unwrap();
    let sigd = imgfmt::BlobSource::resolve_tag(&layout, &sig_tag(&digest)).unwrap();
    let m = imgfmt::source::read_verified_blob(&layout, &sigd, 1 << 20).unwrap();
    let m: serde_json::Value = serde_json::from_slice(&m).unwrap();
    assert_eq!(m["layers"].as_array().unwrap().len(), 3, "{m}");
}
