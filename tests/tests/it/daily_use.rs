//! Pushing sandboxes day to day: hibernations under new time-stamped tags send only what
//! changed (the parent is found by relation, not by tag name), an image this host pushed
//! to one repository goes to another by mounts, and `--sign-key` signs in the same step.
//! Against `snapctl serve` (with htpasswd auth where it matters) and distribution 2.8.

use std::path::Path;

use serde_json::Value;
use snapctl_tests::registry_support::{htpasswd, random_bytes, Distribution, Serve};
use snapctl_tests::{run, Run, Work};

const MIB: u64 = 1 << 20;
const PASSWORD: &str = "pw";

/// A work area whose commands also have the cosign key's password.
fn work() -> Work {
    Work::new().with_env("COSIGN_PASSWORD", PASSWORD)
}

/// Overwrite 1 MiB of `dir`'s vm.mem at `at` (chunk-aligned) with incompressible bytes.
fn change_one_mib(dir: &Path, at: u64, seed: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(dir.join("vm.mem")).unwrap();
    f.write_all_at(&random_bytes(seed, MIB as usize), at).unwrap();
}

/// Bytes of the metadata blobs (config, indexes, outboards: everything but packs) the
/// manifest `digest` of `host/repo` lists: an upper bound of the metadata a push of it
/// sends.
fn metadata_bytes(host: &str, repo: &str, digest: &str, creds: Option<(&str, &str)>) -> u64 {
    use imgfmt::BlobSource;
    let creds = creds.map(|(u, p)| regclient::Credentials::Password { username: u.into(), password: p.into() });
    let c = regclient::RegistrySource::new(host, repo, true, creds).unwrap();
    let d: imgfmt::OciDigest = digest.parse().unwrap();
    let m = imgfmt::Manifest::decode(&c.read_blob_unverified(&d, 4 << 20).unwrap()).unwrap();
    std::iter::once(&m.config).chain(&m.layers).filter(|l| l.media_type != imgfmt::media::PACK).map(|l| l.size).sum::<u64>() + 4096
}

/// A base, then h1..h8 under new tags, each after a 1 MiB change: each push takes the
/// previous hibernation as its parent (stderr says which and why) and sends at most
/// 1.1x the changed bytes plus the image's metadata. Returns the bytes each push sent.
fn hibernations_send_what_changed(host: &str, creds: Option<(&str, &str)>) -> Vec<u64> {
    let w = work();
    if let Some((u, p)) = creds {
        w.credentials(host, u, p);
    }
    let snap = w.sample("snap", "64MiB");
    let repo = format!("{host}/sandboxes/sb");
    let (base, _) = w.json(&["push", snap.to_str().unwrap(), &format!("{repo}:base")]);
    let full = base["bytes_sent"].as_u64().unwrap();
    let mut sent = Vec::new();
    let mut previous = "base".to_string();
    for i in 1..=8u64 {
        change_one_mib(&snap, i * 5 * MIB, 100 + i);
        let tag = format!("h{i}");
        let (r, stderr) = w.json(&["push", snap.to_str().unwrap(), &format!("{repo}:{tag}")]);
        let bytes = r["bytes_sent"].as_u64().unwrap();
        let meta = metadata_bytes(host, "sandboxes/sb", r["manifest"].as_str().unwrap(), creds);
        assert!(stderr.contains(&format!("{repo}:{previous} as the parent")), "h{i}: the previous hibernation is the parent: {stderr}");
        assert!(bytes * 10 <= 11 * MIB + 10 * meta, "h{i}: {bytes} bytes sent for a 1 MiB change (metadata up to {meta}; a full image sent {full}): {stderr}");
        sent.push(bytes);
        previous = tag;
    }
    eprintln!("{host}: base sent {full} bytes; h1..h8 sent {sent:?}");
    // --no-parent turns it off: a full image again.
    change_one_mib(&snap, 50 * MIB, 999);
    let (r, _) = w.json(&["push", snap.to_str().unwrap(), &format!("{repo}:full"), "--no-parent"]);
    assert_eq!(r["pack"]["chain_depth"], 0, "{r}");
    sent
}

#[test]
fn regression_issue_39_new_tags_send_only_what_changed_on_serve() {
    let store = tempfile::tempdir().unwrap();
    let pw = tempfile::tempdir().unwrap();
    htpasswd(&pw.path().join("htpasswd"), &[("alice", "s3cret")]);
    let s = Serve::start(store.path().to_str().unwrap(), &["--htpasswd", pw.path().join("htpasswd").to_str().unwrap()], &[]);
    hibernations_send_what_changed(&s.addr, Some(("alice", "s3cret")));
}

#[test]
fn regression_issue_39_new_tags_send_only_what_changed_on_distribution() {
    if !snapctl_tests::have("docker-registry") {
        eprintln!("skipping: docker-registry is not installed");
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let reg = Distribution::start(d.path());
    hibernations_send_what_changed(&reg.addr, None);
}

/// An image pushed to repository `a` goes to `b` of the same registry by mounts: both a
/// directory (packed again: its packs are mounted as they are sealed) and a layout.
fn second_repository_mounts(host: &str, creds: Option<(&str, &str)>) {
    let w = work();
    if let Some((u, p)) = creds {
        w.credentials(host, u, p);
    }
    let snap = w.sample("snap", "16MiB");
    let (first, _) = w.json(&["push", snap.to_str().unwrap(), &format!("{host}/scratch/a:v1")]);
    assert!(first["bytes_sent"].as_u64().unwrap() > MIB, "{first}");
    let (second, stderr) = w.json(&["push", snap.to_str().unwrap(), &format!("{host}/scratch/b:v1")]);
    let sent = second["bytes_sent"].as_u64().unwrap();
    assert!(sent <= 64 << 10, "{sent} bytes sent to a second repository: {second} {stderr}");
    assert!(second["mounted_blobs"].as_u64().unwrap() > 0, "{second}");
    assert_eq!(second["mounts_declined"], 0, "{second} {stderr}");
    // A layout image pushed to a third repository after the first.
    let lay = format!("oci:{}:v1", w.s("layout"));
    w.ok(&["pack", snap.to_str().unwrap(), &lay]);
    w.json(&["push", &lay, &format!("{host}/scratch/c:v1")]);
    let (third, stderr) = w.json(&["push", &lay, &format!("{host}/scratch/d:v1")]);
    assert!(third["bytes_sent"].as_u64().unwrap() <= 64 << 10, "{third} {stderr}");
    assert_eq!(third["uploaded_blobs"], 0, "{third}");
}

#[test]
fn regression_issue_39_a_second_repository_gets_mounts_on_serve_with_auth() {
    let store = tempfile::tempdir().unwrap();
    let pw = tempfile::tempdir().unwrap();
    htpasswd(&pw.path().join("htpasswd"), &[("alice", "s3cret")]);
    let s = Serve::start(store.path().to_str().unwrap(), &["--htpasswd", pw.path().join("htpasswd").to_str().unwrap()], &[]);
    second_repository_mounts(&s.addr, Some(("alice", "s3cret")));
    assert!(!s.log_text().contains("mount refused"), "{}", s.log_text());
}

#[test]
fn regression_issue_39_a_second_repository_gets_mounts_on_distribution() {
    if !snapctl_tests::have("docker-registry") {
        eprintln!("skipping: docker-registry is not installed");
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let reg = Distribution::start(d.path());
    second_repository_mounts(&reg.addr, None);
}

/// A policy file: every docker image under `scope` must be signed by `pubkey`.
fn policy(w: &Work, scope: &str, pubkey: &str) -> String {
    let text = format!(
        r#"{{"default":[{{"type":"reject"}}],"transports":{{"docker":{{"{scope}":[{{"type":"sigstoreSigned","keyPath":"{pubkey}"}}]}},"oci":{{"":[{{"type":"insecureAcceptAnything"}}]}}}}}}"#
    );
    std::fs::write(w.path("policy.json"), text).unwrap();
    w.s("policy.json")
}

/// Pull `image` under `policy` into `dest`.
fn pull(w: &Work, image: &str, policy: &str, dest: &str) -> Run {
    run(w.cmd().args(["pull", image, &w.s(dest), "--no-cache", "--policy", policy]))
}

/// `push --sign-key` and `copy --sign-key` sign the manifest in the same step: a pull
/// under a policy that requires the key accepts the tag, also after it is pushed again.
#[test]
fn regression_issue_39_push_and_copy_sign_in_the_same_step() {
    let store = tempfile::tempdir().unwrap();
    let s = Serve::start(store.path().to_str().unwrap(), &[], &[]);
    let w = work();
    w.ok(&["key", "generate", "--output-key-prefix", &w.s("k")]);
    let (key, public) = (w.s("k.key"), w.s("k.pub"));
    let policy = policy(&w, &format!("{}/vm", s.addr), &public);
    let snap = w.sample("snap", "4MiB");
    let latest = format!("{}/vm/web:latest", s.addr);

    let (r, stderr) = w.json(&["push", snap.to_str().unwrap(), &latest, "--sign-key", &key]);
    assert!(r["signature"]["tag"].as_str().is_some_and(|t| t.ends_with(".sig")), "{r}");
    assert!(stderr.contains("signed sha256:"), "{stderr}");
    let p = pull(&w, &latest, &policy, "out1");
    assert_eq!(p.code, 0, "{p:?}");
    // Pushed again after a change: the new manifest is signed too.
    change_one_mib(&snap, MIB, 7);
    w.ok(&["push", snap.to_str().unwrap(), &latest, "--sign-key", &key]);
    let p = pull(&w, &latest, &policy, "out2");
    assert_eq!(p.code, 0, "{p:?}");
    // Without the key the policy refuses a fresh push.
    w.ok(&["push", snap.to_str().unwrap(), &format!("{}/vm/web:unsigned", s.addr), "--no-parent"]);
    assert_eq!(pull(&w, &format!("{}/vm/web:unsigned", s.addr), &policy, "out3").code, 1);

    // copy --sign-key: a layout image copied in and signed.
    let lay = format!("oci:{}:v1", w.s("layout"));
    w.ok(&["pack", snap.to_str().unwrap(), &lay]);
    let copied = format!("{}/vm/copied:v1", s.addr);
    let (r, _) = w.json(&["copy", &lay, &copied, "--sign-key", &key]);
    assert!(r["signature"]["key"].as_str().is_some(), "{r}");
    let p = pull(&w, &copied, &policy, "out4");
    assert_eq!(p.code, 0, "{p:?}");
    // A layout destination has no name to certify: refused before anything is copied.
    let r = run(w.cmd().args(["copy", &copied, &format!("oci:{}:v1", w.s("elsewhere")), "--sign-key", &key]));
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("--sign-key"), "{r:?}");
    assert!(!w.path("elsewhere").exists());
}

/// Retention keeps a signature with its subject and deletes it with it: after `:latest`
/// is pushed again (signed), gc collects the old image and its signature tag, and keeps
/// the new one's.
#[test]
fn regression_issue_39_retention_keeps_and_deletes_a_signature_with_its_subject() {
    let w = work();
    let storage = w.path("store");
    let s = Serve::start(storage.to_str().unwrap(), &[], &[]);
    w.ok(&["key", "generate", "--output-key-prefix", &w.s("k")]);
    let key = w.s("k.key");
    let snap = w.sample("snap", "4MiB");
    let latest = format!("{}/vm/web:latest", s.addr);
    let (old, _) = w.json(&["push", snap.to_str().unwrap(), &latest, "--sign-key", &key, "--no-parent"]);
    change_one_mib(&snap, MIB, 8);
    let (new, _) = w.json(&["push", snap.to_str().unwrap(), &latest, "--sign-key", &key, "--no-parent"]);
    let sig = |r: &Value| format!("/v2/vm/web/manifests/{}", r["signature"]["tag"].as_str().unwrap());
    let status = |p: &str| reqwest::blocking::get(s.url(p)).unwrap().status().as_u16();
    assert_eq!((status(&sig(&old)), status(&sig(&new))), (200, 200));
    std::thread::sleep(std::time::Duration::from_millis(50));
    let gc = w.ok(&["gc", "--storage", storage.to_str().unwrap(), "--grace", "0s", "--json"]);
    assert_eq!(status(&format!("/v2/vm/web/manifests/{}", old["manifest"].as_str().unwrap())), 404, "the old image goes: {}", gc.stdout);
    assert_eq!(status(&sig(&old)), 404, "its signature goes with it: {}", gc.stdout);
    assert_eq!(status(&format!("/v2/vm/web/manifests/{}", new["manifest"].as_str().unwrap())), 200);
    assert_eq!(status(&sig(&new)), 200, "the new image keeps its signature: {}", gc.stdout);
}
