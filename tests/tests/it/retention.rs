//! Retention (issue 22 §1) as an operator meets it: `snapctl serve` with a configuration
//! file, `snapctl push` again and again, `snapctl gc` (or the schedule inside `serve`).

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;
use snapctl_tests::registry_support::Serve;
use snapctl_tests::{run, snapctl, Run, Work};

fn ok(cmd: &mut std::process::Command) -> Run {
    let r = run(cmd);
    assert_eq!(r.code, 0, "{cmd:?}: {r:?}");
    r
}

/// Steps of these tests beside [`Work`]'s own.
trait RetentionWork {
    /// A sample snapshot at `name` (seeded), 4 MiB.
    fn seeded(&self, name: &str, seed: &str) -> PathBuf;
    fn push(&self, dir: &Path, dest: &str) -> String;
    fn gc(&self, storage: &Path, extra: &[&str]) -> Value;
}

impl RetentionWork for Work {
    fn seeded(&self, name: &str, seed: &str) -> PathBuf {
        self.sample_with(name, "4MiB", &["--seed", seed])
    }
    fn push(&self, dir: &Path, dest: &str) -> String {
        ok(self.cmd().arg("push").arg(dir).arg(dest)).stdout.trim().to_owned()
    }
    fn gc(&self, storage: &Path, extra: &[&str]) -> Value {
        let r = ok(self.cmd().args(["gc", "--storage", storage.to_str().unwrap(), "--json"]).args(extra));
        serde_json::from_str(&r.stdout).unwrap_or_else(|e| panic!("gc --json ({e}): {}", r.stdout))
    }
}

fn status(url: &str) -> u16 {
    reqwest::blocking::get(url).unwrap().status().as_u16()
}

/// Issue 22: `push DIR vm:latest` twice (the directory changed between); `gc --grace 0s`
/// kept the first snapshot forever (untagged, but still a mark root), with every blob of
/// it. Now it goes; the second still verifies.
#[test]
fn regression_issue_22_gc_collects_the_snapshot_a_repushed_tag_left_behind() {
    let w = Work::new();
    let storage = w.path("store");
    let s = Serve::start(storage.to_str().unwrap(), &[], &[]);
    let a = w.seeded("a", "1");
    let b = w.seeded("b", "2");
    let first = w.push(&a, &format!("{}/vm:latest", s.addr));
    let second = w.push(&b, &format!("{}/vm:latest", s.addr));
    assert_ne!(first, second);
    // gc starts in a later tick of the file clock than the pushes' use marks.
    std::thread::sleep(Duration::from_millis(50));
    let rep = w.gc(&storage, &["--grace", "0s"]);
    assert_eq!(status(&s.url(&format!("/v2/vm/manifests/{first}"))), 404, "the first snapshot stayed: {rep}");
    assert!(rep["swept_bytes"].as_u64().unwrap() > 1 << 20, "its packs went: {rep}");
    let v = rep["retention"]["manifests"].as_array().unwrap().iter().find(|v| v["digest"] == first.as_str()).cloned().unwrap_or_default();
    assert_eq!((v["action"].as_str(), v["rule"].as_str()), (Some("delete"), Some("untagged")), "{rep}");
    ok(w.cmd().args(["verify", &format!("{}/vm:latest", s.addr)]));
}

/// Issue 22: keep rules, and `gc --dry-run --json` naming per manifest the rule that keeps
/// or deletes it and the bytes that go, deleting nothing; the real run then frees exactly
/// those bytes. A policy keeps `latest` only: `pinned` goes by the policy, the image
/// `latest` was moved from as untagged. Before, gc had neither policies nor verdicts.
#[test]
fn regression_issue_22_keep_rules_and_gc_dry_run_json_per_manifest() {
    let w = Work::new();
    let storage = w.path("store");
    let s = Serve::start(storage.to_str().unwrap(), &[], &[]);
    let a = w.seeded("a", "1");
    let b = w.seeded("b", "2");
    let c = w.seeded("c", "3");
    let old = w.push(&a, &format!("{}/vm:latest", s.addr));
    let latest = w.push(&b, &format!("{}/vm:latest", s.addr));
    let pinned = w.push(&c, &format!("{}/vm:pinned", s.addr));
    let cfg = w.path("keep.toml");
    fs::write(&cfg, "[[retention.policies]]\nrepositories = [\"vm\"]\nkeep_tags = [{ patterns = [\"latest\"] }]\n").unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let before = disk_bytes(&storage.join("blobs"));
    let dry = w.gc(&storage, &["--grace", "0s", "--dry-run", "--config", cfg.to_str().unwrap()]);
    assert_eq!(disk_bytes(&storage.join("blobs")), before, "a dry run deletes nothing");
    assert_eq!(status(&s.url("/v2/vm/manifests/pinned")), 200, "a dry run deletes no tag");
    let verdicts = dry["retention"]["manifests"].as_array().unwrap();
    let by = |d: &str| verdicts.iter().find(|v| v["digest"] == d).unwrap_or_else(|| panic!("{d} in {dry}")).clone();
    assert_eq!((by(&latest)["action"].as_str(), by(&latest)["rule"].as_str()), (Some("keep"), Some("tagged")));
    assert_eq!(by(&latest)["via_tag"], "latest");
    assert_eq!(by(&latest)["policy"], 0);
    assert_eq!((by(&pinned)["action"].as_str(), by(&pinned)["rule"].as_str()), (Some("delete"), Some("not_kept")), "{dry}");
    assert_eq!(by(&pinned)["dropped_tags"], serde_json::json!(["pinned"]));
    assert_eq!((by(&old)["action"].as_str(), by(&old)["rule"].as_str()), (Some("delete"), Some("untagged")));
    let own: u64 = [&old, &pinned].iter().map(|d| by(d)["bytes"].as_u64().unwrap()).sum();
    let shared: u64 = [&old, &pinned].iter().map(|d| by(d)["shared_bytes"].as_u64().unwrap()).sum();
    let swept = dry["swept_bytes"].as_u64().unwrap();
    assert!(own > 2 << 20 && own <= swept && swept <= own + shared, "the deletions' bytes are what the sweep frees: {dry}");
    let real = w.gc(&storage, &["--grace", "0s", "--config", cfg.to_str().unwrap()]);
    assert_eq!(real["swept_bytes"], dry["swept_bytes"]);
    assert_eq!(before - disk_bytes(&storage.join("blobs")), swept);
    assert_eq!(status(&s.url("/v2/vm/manifests/pinned")), 404);
    assert_eq!(status(&s.url("/v2/vm/manifests/latest")), 200);
}

/// Bytes of every file under `dir`.
pub(crate) fn disk_bytes(dir: &Path) -> u64 {
    let mut n = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).into_iter().flatten().flatten() {
            let m = e.metadata().unwrap();
            if m.is_dir() {
                stack.push(e.path());
            } else {
                n += m.len();
            }
        }
    }
    n
}

/// `serve --config`: flags and file together (the flag wins), a policy that keeps the one
/// most recently pushed `dev-*` tag, gc on a schedule inside the server; pulls recorded and
/// written (at shutdown here) to one object per repository.
#[test]
fn serve_reads_a_config_file_and_runs_retention_on_a_schedule() {
    let w = Work::new();
    let storage = w.path("store");
    let cfg = w.path("registry.toml");
    fs::write(
        &cfg,
        format!(
            r#"
storage = "{}"
listen = "127.0.0.1:1"            # the flag wins
max_conns_per_client = 16
[gc]
interval = "2s"
grace = "0s"
[retention]
[[retention.policies]]
repositories = ["dev/**"]
keep_tags = [{{ patterns = ["dev-.*"], most_recently_pushed_count = 1 }}, {{ patterns = ["keep"] }}]
"#,
            storage.display()
        ),
    )
    .unwrap();
    let port = snapctl_tests::free_port();
    let mut cmd = snapctl();
    let log = w.path("serve.log");
    cmd.args(["serve", "--config", cfg.to_str().unwrap(), "--listen", &format!("127.0.0.1:{port}")])
        .stdout(std::process::Stdio::null())
        .stderr(fs::File::create(&log).unwrap());
    let mut child = cmd.spawn().unwrap();
    snapctl_tests::registry_support::wait_for_port(port, &mut child, "snapctl serve --config");
    let addr = format!("127.0.0.1:{port}");
    let a = w.seeded("a", "1");
    let b = w.seeded("b", "2");
    let c = w.seeded("c", "3");
    let old = w.push(&a, &format!("{addr}/dev/vm:dev-1"));
    let new = w.push(&b, &format!("{addr}/dev/vm:dev-2"));
    let kept = w.push(&c, &format!("{addr}/dev/vm:keep"));
    ok(w.cmd().args(["inspect", &format!("{addr}/dev/vm:keep")]));
    // The schedule runs within a few seconds (2 s after the server started, then 2 s
    // after each run ends).
    let t = Instant::now();
    while status(&format!("http://{addr}/v2/dev/vm/manifests/dev-1")) != 404 {
        assert!(t.elapsed() < Duration::from_secs(60), "no scheduled gc deleted dev-1: {}", fs::read_to_string(&log).unwrap());
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(status(&format!("http://{addr}/v2/dev/vm/manifests/{old}")), 404);
    assert_eq!(status(&format!("http://{addr}/v2/dev/vm/manifests/dev-2")), 200);
    assert_eq!(status(&format!("http://{addr}/v2/dev/vm/manifests/{new}")), 200);
    assert_eq!(status(&format!("http://{addr}/v2/dev/vm/manifests/keep")), 200);
    assert!(storage.join("_gc/last").exists(), "the run's end is recorded for the schedule");
    // SIGTERM: the pull of `keep` (inspect's GET) is written on the way out.
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert!(child.wait().unwrap().success());
    let pulled: Value = serde_json::from_slice(&fs::read(storage.join("repositories/dev/vm/_pulled")).expect("pull times written")).unwrap();
    assert!(pulled[kept.as_str()].as_u64().is_some(), "{pulled}");
    assert!(pulled.get(old.as_str()).is_none(), "gc forgets the pulls of what it deleted: {pulled}");
}

/// A configuration file that is wrong stops `serve` and `gc` with a clear message (exit 2).
#[test]
fn a_bad_config_file_is_refused() {
    let w = Work::new();
    let cfg = w.path("bad.toml");
    fs::write(&cfg, "[retention]\n[[retention.policies]]\nkeep_tags = [{ patterns = [\"(\"] }]\n").unwrap();
    let r = run(w.cmd().args(["gc", "--storage", w.path("s").to_str().unwrap(), "--config", cfg.to_str().unwrap()]));
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("keep_tags entry 0: pattern \"(\""), "{}", r.stderr);
    fs::write(&cfg, "listen = 5000\n").unwrap();
    let r = run(w.cmd().args(["serve", "--config", cfg.to_str().unwrap()]));
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("listen"), "{}", r.stderr);
    let r = run(w.cmd().args(["gc"]));
    assert_eq!(r.code, 2);
    assert!(r.stderr.contains("--storage"), "{}", r.stderr);
}

/// A configuration keeping only tags pulled within the last hour; gc never scheduled
/// inside the server (the test runs `snapctl gc` itself).
fn pulled_within_config(w: &Work, storage: &str) -> PathBuf {
    let cfg = w.path("pulled.toml");
    fs::write(
        &cfg,
        format!(
            r#"
storage = "{storage}"
[gc]
interval = "0"
grace = "0s"
[[retention.policies]]
repositories = ["**"]
keep_tags = [{{ patterns = [".*"], pulled_within = "1h" }}]
"#
        ),
    )
    .unwrap();
    cfg
}

/// `pulled_within` against pull times `serve` recorded over `storage` (a directory or
/// s3://…, with `env`): two tags pushed, one pulled; the pull is not written per GET
/// (`on_disk`: where a directory store would hold it), but at SIGTERM; then `gc` keeps
/// the pulled tag and deletes the other (the dry run says so first, naming the rule).
fn pulled_within_keeps_what_was_pulled(storage: &str, env: &[(&str, &str)], on_disk: Option<&Path>) {
    let w = Work::new();
    let cfg = pulled_within_config(&w, storage);
    let mut s = Serve::start(storage, &["--config", cfg.to_str().unwrap()], env);
    let a = w.seeded("a", "1");
    let b = w.seeded("b", "2");
    let pulled = w.push(&a, &format!("{}/vm:pulled", s.addr));
    let idle = w.push(&b, &format!("{}/vm:idle", s.addr));
    let r =
        reqwest::blocking::Client::new().get(s.url("/v2/vm/manifests/pulled")).header("accept", "application/vnd.oci.image.manifest.v1+json").send().unwrap();
    assert_eq!(r.status(), 200);
    if let Some(dir) = on_disk {
        assert!(!dir.join("repositories/vm/_pulled").exists(), "a pull is not a write");
    }
    assert!(s.terminate().success(), "{}", s.log_text());
    if let Some(dir) = on_disk {
        assert!(dir.join("repositories/vm/_pulled").exists(), "written at shutdown");
    }
    let gc = |extra: &[&str]| -> Value {
        let mut c = w.cmd();
        c.args(["gc", "--config", cfg.to_str().unwrap(), "--json"]).args(extra);
        for (k, v) in env {
            c.env(k, v);
        }
        let r = ok(&mut c);
        serde_json::from_str(&r.stdout).unwrap_or_else(|e| panic!("gc --json ({e}): {}", r.stdout))
    };
    // S3 mtimes have whole seconds: gc counts what was used in the second it starts as in
    // use (spec/registry.md §4); start it in a later second than the pushes.
    std::thread::sleep(Duration::from_millis(1100));
    let dry = gc(&["--dry-run"]);
    let tag = |rep: &Value, t: &str| rep["retention"]["tags"].as_array().unwrap().iter().find(|v| v["tag"] == t).cloned().unwrap_or_default();
    assert_eq!((tag(&dry, "pulled")["action"].as_str(), tag(&dry, "pulled")["by"].as_str()), (Some("keep"), Some("pulled_within")), "{dry}");
    assert_eq!((tag(&dry, "idle")["action"].as_str(), tag(&dry, "idle")["rule"].as_str()), (Some("delete"), Some("not_kept")), "{dry}");
    let m = |rep: &Value, d: &str| rep["retention"]["manifests"].as_array().unwrap().iter().find(|v| v["digest"] == d).cloned().unwrap_or_default();
    assert!(m(&dry, &pulled)["pulled"].as_u64().is_some(), "the recorded pull time is reported: {dry}");
    assert_eq!(m(&dry, &idle)["action"], "delete", "{dry}");
    let real = gc(&[]);
    assert_eq!(real["tags_removed"], 1, "{real}");
    let s = Serve::start(storage, &[], env);
    assert_eq!(status(&s.url("/v2/vm/manifests/pulled")), 200);
    assert_eq!(status(&s.url("/v2/vm/manifests/idle")), 404);
    assert_eq!(status(&s.url(&format!("/v2/vm/manifests/{idle}"))), 404);
}

/// Issue 22: `pulled_within` on a directory store. Before, no pull was recorded (and gc
/// had no policies), so nothing told a pulled tag from an idle one.
#[test]
fn regression_issue_22_pulled_within_uses_recorded_pull_times_on_fs() {
    let dir = tempfile::tempdir().unwrap();
    let storage = dir.path().join("store");
    pulled_within_keeps_what_was_pulled(storage.to_str().unwrap(), &[], Some(&storage));
}

/// Issue 22: `pulled_within` on an S3 store (moto, or s3s-fs).
#[test]
fn regression_issue_22_pulled_within_uses_recorded_pull_times_on_s3() {
    let Some(s3) = snapctl_tests::registry_support::S3Server::start("pulls") else { return };
    let env = s3.env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    pulled_within_keeps_what_was_pulled("s3://pulls/reg", &env, None);
}

/// Issue 22: an artifact (a trace, as `snapctl lazy` would push one) attached to an image
/// that a client then deletes. The referrer stayed, and `/referrers/<subject>` kept
/// listing it. Now gc deletes it with its subject and the listing is empty.
#[test]
fn regression_issue_22_a_referrer_dies_with_its_subject_and_leaves_the_listing() {
    let w = Work::new();
    let storage = w.path("store");
    let s = Serve::start(storage.to_str().unwrap(), &[], &[]);
    let a = w.seeded("a", "1");
    let subject = w.push(&a, &format!("{}/vm:v1", s.addr));
    let c = reqwest::blocking::Client::new();
    let put_blob = |data: &[u8]| -> String {
        let d = snapctl_tests::registry_support::sha256(data);
        let r = c.post(s.url(&format!("/v2/vm/blobs/uploads/?digest={d}"))).body(data.to_vec()).send().unwrap();
        assert_eq!(r.status(), 201, "{}", r.text().unwrap());
        d
    };
    let payload: Vec<u8> = (0..300_000u32).flat_map(|i| i.wrapping_mul(2_654_435_761).to_le_bytes()).collect();
    let layer = put_blob(&payload);
    let empty = put_blob(b"{}");
    let m = serde_json::json!({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "artifactType": "application/vnd.snapctl.trace.v1+json",
        "config": {"mediaType": "application/vnd.oci.empty.v1+json", "digest": empty, "size": 2},
        "layers": [{"mediaType": "application/octet-stream", "digest": layer, "size": payload.len()}],
        "subject": {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": subject, "size": 1}});
    let body = serde_json::to_vec(&m).unwrap();
    let referrer = snapctl_tests::registry_support::sha256(&body);
    let r =
        c.put(s.url(&format!("/v2/vm/manifests/{referrer}"))).header("content-type", "application/vnd.oci.image.manifest.v1+json").body(body).send().unwrap();
    assert_eq!(r.status(), 201);
    let listed = |s: &Serve| -> usize {
        let v: Value = c.get(s.url(&format!("/v2/vm/referrers/{subject}"))).send().unwrap().json().unwrap();
        v["manifests"].as_array().map_or(0, Vec::len)
    };
    assert_eq!(listed(&s), 1);
    assert_eq!(c.delete(s.url(&format!("/v2/vm/manifests/{subject}"))).send().unwrap().status(), 202);
    std::thread::sleep(Duration::from_millis(50));
    let rep = w.gc(&storage, &["--grace", "0s"]);
    assert_eq!(listed(&s), 0, "{rep}");
    assert_eq!(status(&s.url(&format!("/v2/vm/manifests/{referrer}"))), 404);
    assert_eq!(status(&s.url(&format!("/v2/vm/blobs/{layer}"))), 404, "the trace's payload is freed: {rep}");
    let v = rep["retention"]["manifests"].as_array().into_iter().flatten().find(|v| v["digest"] == referrer.as_str()).cloned().unwrap_or_default();
    assert_eq!((v["action"].as_str(), v["rule"].as_str()), (Some("delete"), Some("subject_gone")), "{rep}");
}

/// Issue 35: `snapctl gc` stopped by SIGTERM or Ctrl-C (SIGINT) left `_gc/run` and its
/// marks: for 5 minutes every gc refused to start, and requests relying on a marked blob
/// waited 30 s for a 503. It removes them on the way out now (exit 2, "stopped").
///
/// To stop it mid-run every time, the store holds one manifest whose bytes are a FIFO:
/// gc's scan blocks reading it, holding `_gc/run`, until the test opens the other end.
#[test]
fn regression_issue_35_gc_stopped_by_a_signal_removes_its_marks() {
    use std::os::unix::fs::OpenOptionsExt;
    for sig in [libc::SIGTERM, libc::SIGINT] {
        let w = Work::new();
        let storage = w.path("store");
        let hex = snapctl_tests::registry_support::sha256(b"a manifest gc cannot finish reading").trim_start_matches("sha256:").to_owned();
        let link = storage.join(format!("repositories/vm/_manifests/sha256/{hex}"));
        fs::create_dir_all(link.parent().unwrap()).unwrap();
        fs::write(&link, "application/vnd.oci.image.manifest.v1+json").unwrap();
        let fifo = storage.join(format!("blobs/sha256/{}/{hex}", &hex[..2]));
        fs::create_dir_all(fifo.parent().unwrap()).unwrap();
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: mkfifo(3) on a NUL-terminated path we own.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let mut child = w
            .cmd()
            .args(["gc", "--storage", storage.to_str().unwrap(), "--grace", "0s"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let run = storage.join("_gc/run");
        let t = Instant::now();
        while !run.exists() {
            assert!(t.elapsed() < Duration::from_secs(30) && child.try_wait().unwrap().is_none(), "gc did not start");
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(200)); // well into the scan
                                                        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(child.id() as i32, sig) };
        let t = Instant::now();
        while run.exists() && t.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let left = run.exists();
        // Let the blocked read end (no reader left: nothing to do).
        drop(fs::OpenOptions::new().write(true).custom_flags(libc::O_NONBLOCK).open(&fifo));
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!left, "signal {sig}: _gc/run left behind ({:?}): {stderr}", out.status);
        assert_eq!(out.status.code(), Some(2), "signal {sig}: {stderr}");
        assert!(stderr.contains("stopped"), "signal {sig}: {stderr}");
        let marks: Vec<_> = ["_gc/condemned", "_gc/retiring"].iter().flat_map(|d| fs::read_dir(storage.join(d)).into_iter().flatten().flatten()).collect();
        assert!(marks.is_empty(), "signal {sig}: marks left: {marks:?}");
        // The next gc starts at once.
        fs::remove_file(&fifo).unwrap();
        fs::remove_file(&link).unwrap();
        ok(w.cmd().args(["gc", "--storage", storage.to_str().unwrap()]));
    }
}

/// Issue 35: `most_recently_pushed_count = 0` in a policy with no `repositories` list
/// deleted every tag of every repository, with no warning. `gc` refuses that file and
/// says how to write it on purpose; written so, `gc --dry-run` warns.
#[test]
fn regression_issue_35_a_keep_count_of_zero_everywhere_is_refused_or_warned_about() {
    let w = Work::new();
    let storage = w.path("store");
    let cfg = w.path("zero.toml");
    fs::write(&cfg, "[[retention.policies]]\nkeep_tags = [{ most_recently_pushed_count = 0 }]\n").unwrap();
    let r = run(w.cmd().args(["gc", "--storage", storage.to_str().unwrap(), "--config", cfg.to_str().unwrap(), "--dry-run"]));
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("most_recently_pushed_count = 0 keeps no tag") && r.stderr.contains("repositories = [\"**\"]"), "{}", r.stderr);
    fs::write(&cfg, "[[retention.policies]]\nrepositories = [\"**\"]\nkeep_tags = [{ most_recently_pushed_count = 0 }]\n").unwrap();
    let r = ok(w.cmd().args(["gc", "--storage", storage.to_str().unwrap(), "--config", cfg.to_str().unwrap(), "--dry-run"]));
    assert!(r.stderr.lines().any(|l| l.starts_with("warning: ") && l.contains("most_recently_pushed_count = 0 keeps no tag")), "{}", r.stderr);
}

/// Issue 39: "last pulled" counted reads that restore nothing. A push resolving its parent
/// by tag and an `inspect` each recorded a pull, so `pulled_within` kept images nobody
/// restored. Now a pull is a restore: `snapctl pull` (and unpack, lazy, mount, copy's
/// source) says so (`Snapctl-Purpose: restore`), snapctl's other reads say they are not,
/// and a client that says nothing (skopeo, oras) is taken to be restoring.
#[test]
fn regression_issue_39_only_restores_count_as_pulls() {
    let w = Work::new();
    let storage = w.path("store");
    let cfg = pulled_within_config(&w, storage.to_str().unwrap());
    let mut s = Serve::start(storage.to_str().unwrap(), &["--config", cfg.to_str().unwrap()], &[]);
    let r = |tag: &str| format!("{}/vm:{tag}", s.addr);
    for (dir, seed, tag) in [("a", "1", "pulled"), ("b", "2", "inspected"), ("c", "3", "parent"), ("e", "5", "foreign")] {
        let p = w.seeded(dir, seed);
        w.push(&p, &r(tag));
    }
    // The parent is resolved by its tag: a read, not a restore.
    let d = w.seeded("d", "4");
    ok(w.cmd().arg("push").arg(&d).arg(r("child")).args(["--parent", &r("parent")]));
    ok(w.cmd().args(["pull", &r("pulled")]).arg(w.path("restored")));
    ok(w.cmd().args(["inspect", &r("inspected")]));
    let foreign =
        reqwest::blocking::Client::new().get(s.url("/v2/vm/manifests/foreign")).header("accept", "application/vnd.oci.image.manifest.v1+json").send().unwrap();
    assert_eq!(foreign.status(), 200);
    assert!(s.terminate().success(), "{}", s.log_text());
    std::thread::sleep(Duration::from_millis(50));
    let r = ok(w.cmd().args(["gc", "--config", cfg.to_str().unwrap(), "--json", "--dry-run"]));
    let dry: Value = serde_json::from_str(&r.stdout).unwrap();
    let tag = |t: &str| dry["retention"]["tags"].as_array().unwrap().iter().find(|v| v["tag"] == t).cloned().unwrap_or_default();
    for kept in ["pulled", "foreign"] {
        assert_eq!((tag(kept)["action"].as_str(), tag(kept)["by"].as_str()), (Some("keep"), Some("pulled_within")), "{kept}: {dry}");
    }
    for idle in ["inspected", "parent", "child"] {
        assert_eq!(tag(idle)["action"].as_str(), Some("delete"), "{idle} was not restored: {dry}");
    }
}
