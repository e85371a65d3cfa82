//! Retention (issue 22 §1) as an operator meets it: `snapctl serve` with a configuration
//! file, `snapctl push` again and again, `snapctl gc` (or the schedule inside `serve`).

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;
use snapctl_tests::registry_support::Serve;
use snapctl_tests::{run, snapctl, Run};

fn ok(cmd: &mut std::process::Command) -> Run {
    let r = run(cmd);
    assert_eq!(r.code, 0, "{cmd:?}: {r:?}");
    r
}

/// A work directory with its own cache and docker config.
struct Work {
    dir: tempfile::TempDir,
}

impl Work {
    fn new() -> Work {
        Work { dir: tempfile::tempdir().unwrap() }
    }
    fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }
    fn cmd(&self) -> std::process::Command {
        let mut c = snapctl();
        c.env("SNAPCTL_CACHE", self.path("cache")).env("DOCKER_CONFIG", self.path("docker"));
        c
    }
    /// A sample snapshot at `name` (seeded), 4 MiB.
    fn sample(&self, name: &str, seed: &str) -> PathBuf {
        let p = self.path(name);
        ok(self.cmd().arg("sample").arg(&p).args(["--size", "4MiB", "--seed", seed]));
        p
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
    let a = w.sample("a", "1");
    let b = w.sample("b", "2");
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

/// `gc --dry-run --json` names, per manifest, the rule that keeps or deletes it and the
/// bytes that go, and deletes nothing; the real run then frees exactly those bytes.
#[test]
fn gc_dry_run_says_per_manifest_which_rule_and_how_many_bytes() {
    let w = Work::new();
    let storage = w.path("store");
    let s = Serve::start(storage.to_str().unwrap(), &[], &[]);
    let a = w.sample("a", "1");
    let b = w.sample("b", "2");
    let c = w.sample("c", "3");
    let old = w.push(&a, &format!("{}/vm:latest", s.addr));
    let latest = w.push(&b, &format!("{}/vm:latest", s.addr));
    let pinned = w.push(&c, &format!("{}/vm:pinned", s.addr));
    std::thread::sleep(Duration::from_millis(50));
    let before = disk_bytes(&storage.join("blobs"));
    let dry = w.gc(&storage, &["--grace", "0s", "--dry-run"]);
    assert_eq!(disk_bytes(&storage.join("blobs")), before, "a dry run deletes nothing");
    let verdicts = dry["retention"]["manifests"].as_array().unwrap();
    let by = |d: &str| verdicts.iter().find(|v| v["digest"] == d).unwrap_or_else(|| panic!("{d} in {dry}")).clone();
    assert_eq!(by(&latest)["rule"], "tagged");
    assert_eq!(by(&latest)["via_tag"], "latest");
    assert_eq!(by(&pinned)["rule"], "tagged");
    assert_eq!(by(&old)["rule"], "untagged");
    assert_eq!(by(&old)["action"], "delete");
    let going = by(&old)["bytes"].as_u64().unwrap() + by(&old)["shared_bytes"].as_u64().unwrap();
    assert_eq!(going, dry["swept_bytes"].as_u64().unwrap(), "the deletion's bytes are what the sweep frees: {dry}");
    let real = w.gc(&storage, &["--grace", "0s"]);
    assert_eq!(real["swept_bytes"], dry["swept_bytes"]);
    assert_eq!(before - disk_bytes(&storage.join("blobs")), going);
}

/// Bytes of every file under `dir`.
fn disk_bytes(dir: &Path) -> u64 {
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
    let a = w.sample("a", "1");
    let b = w.sample("b", "2");
    let c = w.sample("c", "3");
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
