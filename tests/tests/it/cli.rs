//! What a first user meets at the command line (issue 13 §2): a closed stdout, client
//! warnings on stderr, skopeo's `docker://` spelling, one duration grammar.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use snapctl_tests::registry_support::Serve;
use snapctl_tests::{run, snapctl, Run};

/// A scratch area with its own snapctl cache and Docker config.
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
    fn cmd(&self) -> Command {
        let mut c = snapctl();
        c.env("SNAPCTL_CACHE", self.path("cache")).env("DOCKER_CONFIG", self.path("docker"));
        c
    }
    fn ok(&self, args: &[&str]) -> Run {
        let r = run(self.cmd().args(args));
        assert_eq!(r.code, 0, "snapctl {args:?}: {r:?}");
        r
    }
    /// `snapctl sample` of `size` into a new directory, packed as `oci:<dir>/l:<tag>`.
    fn packed(&self, name: &str, size: &str, tag: &str) -> (PathBuf, String) {
        let src = self.path(name);
        self.ok(&["sample", src.to_str().unwrap(), "--size", size]);
        let r = format!("oci:{}:{tag}", self.path("l").display());
        self.ok(&["pack", src.to_str().unwrap(), &r]);
        (src, r)
    }
}

/// Run `cmd` with stdout a pipe whose reading end is already closed (what `| head -n 3`
/// leaves once head has exited).
fn run_into_closed_pipe(cmd: &mut Command) -> Run {
    let (reader, writer) = std::io::pipe().expect("pipe");
    drop(reader);
    let out = cmd.stdin(Stdio::null()).stdout(writer).stderr(Stdio::piped()).output().expect("spawn");
    Run { code: out.status.code().unwrap_or(-1), stdout: String::new(), stderr: String::from_utf8_lossy(&out.stderr).into_owned() }
}

/// Issue 13: `snapctl inspect REF | head -n 3` panicked ("failed printing to stdout: Broken
/// pipe"). Every command that writes to stdout now ends quietly, status 0, when its reader
/// has gone: no panic, no error line.
#[test]
fn regression_issue_13_closed_stdout_ends_quietly_with_status_0() {
    let w = Work::new();
    let (src, a) = w.packed("snap", "2MiB", "a");
    w.ok(&["sample", src.to_str().unwrap(), "--size", "2MiB", "--mutate", "2"]);
    let b = format!("oci:{}:b", w.path("l").display());
    w.ok(&["pack", src.to_str().unwrap(), &b, "--parent", &a]);
    let storage = w.path("storage");
    std::fs::create_dir_all(&storage).unwrap();
    let s = Serve::start(storage.to_str().unwrap(), &[], &[]);
    let remote = format!("{}/vm/pipe:v1", s.addr);
    w.ok(&["push", &a, &remote]);
    let (src_s, st, lay2) = (src.to_str().unwrap(), storage.to_str().unwrap(), format!("oci:{}:c", w.path("l2").display()));
    let commands: Vec<Vec<String>> = [
        &["inspect", &a][..],
        &["inspect", &a, "--json"],
        &["inspect", &remote],
        &["verify", &a, "--json"],
        &["diff", &a, &b],
        &["diff", &a, &b, "--json"],
        &["pack", src_s, &format!("oci:{}:p", w.path("l3").display())],
        &["pack", src_s, &format!("oci:{}:q", w.path("l3").display()), "--json"],
        &["unpack", &a, w.path("out1").to_str().unwrap(), "--json"],
        &["copy", &a, &lay2, "--json"],
        &["push", &b, &format!("{}/vm/pipe:v2", s.addr)],
        &["push", &b, &format!("{}/vm/pipe2:v2", s.addr), "--json"],
        &["pull", &remote, w.path("out2").to_str().unwrap(), "--json"],
        &["gc", "--storage", st, "--dry-run"],
        &["gc", "--storage", st, "--dry-run", "--json"],
        &["--help"],
        &["inspect", "--help"],
        &["--version"],
    ]
    .iter()
    .map(|c| c.iter().map(|s| s.to_string()).collect())
    .collect();
    for c in &commands {
        let r = run_into_closed_pipe(w.cmd().args(c));
        assert!(!r.stderr.contains("panicked"), "snapctl {c:?} panicked on a closed stdout: {}", r.stderr);
        assert!(!r.stderr.contains("Broken pipe") && !r.stderr.contains("snapctl:"), "snapctl {c:?}: an error line for a closed stdout: {}", r.stderr);
        assert_eq!(r.code, 0, "snapctl {c:?} on a closed stdout: {r:?}");
    }
    // The same commands still print in full to an open stdout.
    let r = w.ok(&["inspect", &a]);
    assert!(r.stdout.lines().count() > 5 && r.stdout.contains("total"), "{r:?}");
}

/// The pack of `sample 2MiB` is bigger than this, so its upload goes in several PATCHes and
/// saves resume state after each one.
const SMALL_PIECE: &str = "64KiB";

/// Issue 13: only `serve` installed a log subscriber, so a library's warning in a client
/// command went nowhere. Push with an upload-state directory that cannot be created: the
/// registry client's `tracing::warn!` reaches stderr by default; `SNAPCTL_LOG`, then
/// `RUST_LOG`, set the level.
#[test]
fn regression_issue_13_client_warnings_reach_stderr() {
    let w = Work::new();
    let (_, a) = w.packed("snap", "2MiB", "a");
    let storage = w.path("storage");
    std::fs::create_dir_all(&storage).unwrap();
    let s = Serve::start(storage.to_str().unwrap(), &[], &[]);
    let push = |n: u32, env: &[(&str, &str)]| -> Run {
        // A fresh cache per push (so nothing is mounted from an earlier repository), where
        // `uploads` is a file: the resume state cannot be saved.
        let cache = w.path(&format!("cache{n}"));
        std::fs::create_dir_all(&cache).unwrap();
        std::fs::write(cache.join("uploads"), b"not a directory").unwrap();
        let mut c = w.cmd();
        c.args(["push", &a, &format!("{}/vm/log{n}:v1", s.addr), "--upload-piece", SMALL_PIECE, "--cache", cache.to_str().unwrap()]);
        for (k, v) in env {
            c.env(k, v);
        }
        let r = run(&mut c);
        assert_eq!(r.code, 0, "a push whose resume state cannot be saved still completes: {r:?}");
        r
    };
    let warned = |r: &Run| r.stderr.contains("cannot save upload state");
    let r = push(1, &[]);
    assert!(warned(&r), "the warning reaches stderr by default: {}", r.stderr);
    assert!(r.stderr.contains("WARN"), "with its level: {}", r.stderr);
    assert_eq!(r.stderr.matches("cannot save upload state").count(), 1, "once per blob, not once per piece: {}", r.stderr);
    let r = push(2, &[("SNAPCTL_LOG", "error")]);
    assert!(!warned(&r), "SNAPCTL_LOG=error silences it: {}", r.stderr);
    let r = push(3, &[("RUST_LOG", "error")]);
    assert!(!warned(&r), "RUST_LOG=error silences it: {}", r.stderr);
    let r = push(4, &[("SNAPCTL_LOG", "warn"), ("RUST_LOG", "error")]);
    assert!(warned(&r), "SNAPCTL_LOG wins over RUST_LOG: {}", r.stderr);
}

/// Issue 13: skopeo spells a registry reference `docker://HOST/REPO:TAG`; snapctl refused it
/// with a name-grammar error. It is accepted wherever a reference is.
#[test]
fn regression_issue_13_docker_transport_prefix_is_a_registry_reference() {
    let w = Work::new();
    let (_, a) = w.packed("snap", "2MiB", "a");
    let storage = w.path("storage");
    std::fs::create_dir_all(&storage).unwrap();
    let s = Serve::start(storage.to_str().unwrap(), &[], &[]);
    let remote = format!("docker://{}/vm/skopeo:v1", s.addr);
    let pushed = w.ok(&["push", &a, &remote]).stdout;
    let r = w.ok(&["inspect", &remote, "--json"]);
    let j: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    assert_eq!(j["manifest"].as_str().unwrap(), pushed.trim());
    w.ok(&["verify", &remote]);
    w.ok(&["copy", &remote, &format!("docker://{}/vm/skopeo2:v1", s.addr)]);
    w.ok(&["pull", &format!("docker://{}/vm/skopeo2:v1", s.addr), w.path("out").to_str().unwrap()]);
    // Docker Hub short names are not guessed: the message says what to write.
    let r = run(w.cmd().args(["inspect", "docker://alpine:3"]));
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("docker://HOST[:PORT]/REPO"), "says what to write: {}", r.stderr);
}

fn gc_json(storage: &Path, extra: &[&str]) -> Run {
    run(snapctl().args(["gc", "--storage", storage.to_str().unwrap(), "--json", "--dry-run"]).args(extra))
}

/// Issue 13: `gc --grace 500ms` and `lazy --retry-budget 1h` were refused: two duration
/// grammars. One parser takes ms, s, m, h, d and combinations for every duration flag.
#[test]
fn regression_issue_13_one_duration_grammar_for_every_flag() {
    let w = Work::new();
    let storage = w.path("storage");
    std::fs::create_dir_all(&storage).unwrap();
    for d in ["500ms", "90s", "1h", "1h30m", "7d", "0", "120"] {
        let r = gc_json(&storage, &["--grace", d, "--upload-ttl", d]);
        assert_eq!(r.code, 0, "gc --grace {d}: {r:?}");
    }
    let r = gc_json(&storage, &["--grace", "soon"]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("--grace") && r.stderr.contains("1h30m"), "names the flag and an example: {}", r.stderr);

    // lazy: the duration is accepted, so the command gets as far as opening the image.
    let missing = format!("oci:{}", w.path("missing").display());
    for d in ["1h", "500ms", "2m", "1h30m", "120"] {
        let r = run(snapctl().args(["lazy", &missing, "--socket", w.path("s.sock").to_str().unwrap(), "--retry-budget", d]));
        assert_eq!(r.code, 2, "{r:?}");
        assert!(!r.stderr.contains("invalid value"), "lazy --retry-budget {d} is accepted: {}", r.stderr);
        assert!(r.stderr.contains("missing"), "fails on the missing image instead: {}", r.stderr);
    }
    let r = run(snapctl().args(["lazy", &missing, "--socket", "x", "--retry-budget=-1s"]));
    assert!(r.code == 2 && r.stderr.contains("invalid value"), "{r:?}");
    // The help texts say what is accepted.
    for (cmd, flag) in [("gc", "--grace"), ("lazy", "--retry-budget")] {
        let r = run(snapctl().args([cmd, "--help"]));
        let line = r.stdout.lines().skip_while(|l| !l.trim_start().starts_with(flag)).take(4).collect::<Vec<_>>().join(" ");
        assert!(line.contains("ms") && line.contains("1h30m"), "{cmd} --help documents the grammar: {line}");
    }
}
