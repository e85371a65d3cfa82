//! gVisor round trips (issue 4, "Real runtimes"; issue 13 §3): a stateful program under
//! `runsc --platform=ptrace --network=none`, `runsc checkpoint`, `snapctl push` to a
//! `snapctl serve`, container deleted, `snapctl pull` on a second "host" (its own cache,
//! bundle, state root and output directory), `runsc restore`, and the program goes on:
//! its counter continues past the checkpoint and its heap checksum still matches.
//!
//! Two gVisors, two checkpoint formats:
//! - Debian bookworm's runsc (2022, on PATH) writes one `checkpoint.img`;
//! - Debian trixie's runsc 0.0~20240729 (`scripts/install-trixie.sh runsc`, found as
//!   `$SNAPCTL_RUNSC_SPLIT`, else `/opt/snapctl-runsc/runsc`), run as
//!   `runsc checkpoint --compression=none --exclude-committed-zero-pages`, writes the split
//!   format the gVisor posts describe: `checkpoint.img` (kernel state), `pages_meta.img` and
//!   `pages.img` (raw memory, uncompressed, committed zero pages left out).
//!
//! The program is `tests/runtimes/counter.c` (`snapctl_tests::counter`), built static with
//! gcc at test time. Skips (loudly) without runsc, gcc, root or a working ptrace platform;
//! with `SNAPCTL_REQUIRE_PEERS=1` those are failures.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use snapctl_tests::counter::{self, sha256_file, ticks, wait_for_count};
use snapctl_tests::registry_support::Serve;
use snapctl_tests::{have, require_peers, run, snapctl};

/// Skip with a note, or fail when peers are required.
pub(crate) fn skip(why: &str) {
    assert!(!require_peers(), "runsc round trip cannot run (SNAPCTL_REQUIRE_PEERS=1): {why}");
    eprintln!("SKIP: runsc round trip: {why}");
}

/// One `runsc` binary and state root ("a host"); kills and deletes its containers on drop.
pub(crate) struct Runsc {
    pub(crate) bin: PathBuf,
    pub(crate) root: PathBuf,
    pub(crate) ids: Vec<String>,
}

impl Runsc {
    pub(crate) fn cmd(&self) -> Command {
        let mut c = Command::new(&self.bin);
        c.args(["--platform=ptrace", "--network=none", "--root"]).arg(&self.root);
        c.stdin(Stdio::null());
        c
    }

    /// Run `args` (a detached `run` or `restore` of container `id`), recording `id` for
    /// cleanup. Output goes to a file, not a pipe: the detached sandbox inherits it and
    /// keeps it open, so reading a pipe to EOF would wait for the container to die.
    pub(crate) fn start(&mut self, id: &str, args: &[&str]) -> snapctl_tests::Run {
        self.ids.push(id.to_string());
        std::fs::create_dir_all(&self.root).unwrap();
        let log = self.root.join(format!("{id}.log"));
        let f = std::fs::File::create(&log).unwrap();
        let status = self.cmd().args(args).stdout(f.try_clone().unwrap()).stderr(f).status().expect("spawn runsc");
        snapctl_tests::Run { code: status.code().unwrap_or(-1), stdout: String::new(), stderr: std::fs::read_to_string(&log).unwrap_or_default() }
    }
}

impl Drop for Runsc {
    fn drop(&mut self) {
        for id in &self.ids {
            let _ = self.cmd().args(["kill", id, "KILL"]).stdout(Stdio::null()).stderr(Stdio::null()).status();
            let _ = self.cmd().args(["delete", "-force", id]).stdout(Stdio::null()).stderr(Stdio::null()).status();
        }
    }
}

/// An OCI bundle at `dir` running `/counter /out/progress`, with `out` bind-mounted at /out.
pub(crate) fn bundle(runsc: &Path, dir: &Path, counter: &Path, out: &Path) {
    let rootfs = dir.join("rootfs");
    std::fs::create_dir_all(&rootfs).unwrap();
    std::fs::create_dir_all(out).unwrap();
    std::fs::copy(counter, rootfs.join("counter")).unwrap();
    let r = run(Command::new(runsc).current_dir(dir).args(["spec", "--", "/counter", "/out/progress"]));
    assert_eq!(r.code, 0, "runsc spec: {}", r.stderr);
    let path = dir.join("config.json");
    let mut c: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    c["process"]["terminal"] = false.into();
    c["root"]["readonly"] = true.into();
    c["mounts"].as_array_mut().unwrap().push(serde_json::json!({
        "destination": "/out", "type": "bind", "source": out, "options": ["rbind", "rw"]
    }));
    std::fs::write(&path, serde_json::to_vec_pretty(&c).unwrap()).unwrap();
}

/// Which gVisor, and how it checkpoints.
struct Flavor {
    bin: PathBuf,
    /// Extra `runsc checkpoint` flags.
    checkpoint: &'static [&'static str],
    /// The files the checkpoint must hold, with the role snapctl gives each.
    files: &'static [(&'static str, &'static str)],
    /// Extra `snapctl push` flags.
    push: &'static [&'static str],
}

#[test]
fn runsc_checkpoint_push_pull_restore_continues_the_counter() {
    // `have` fails the test itself when peers are required.
    if !have("runsc") {
        return;
    }
    round_trip(Flavor { bin: "runsc".into(), checkpoint: &[], files: &[("checkpoint.img", "state")], push: &[] });
}

/// The split format of the gVisor posts, from trixie's runsc, packed with `--kind gvisor`.
#[test]
fn regression_issue_13_runsc_2024_split_checkpoint_push_pull_restore_continues_the_counter() {
    let bin = std::env::var_os("SNAPCTL_RUNSC_SPLIT").map(PathBuf::from).unwrap_or_else(|| "/opt/snapctl-runsc/runsc".into());
    if !bin.is_file() {
        return skip(&format!("no runsc 2024 at {} (run `bash scripts/install-trixie.sh runsc`, or set SNAPCTL_RUNSC_SPLIT)", bin.display()));
    }
    round_trip(Flavor {
        bin,
        checkpoint: &["--compression=none", "--exclude-committed-zero-pages"],
        files: &[("checkpoint.img", "state"), ("pages.img", "pages"), ("pages_meta.img", "metadata")],
        push: &["--kind", "gvisor"],
    });
}

fn round_trip(flavor: Flavor) {
    if !have("gcc") {
        return;
    }
    // SAFETY: geteuid has no preconditions and touches no memory.
    if unsafe { libc::geteuid() } != 0 {
        return skip("runsc needs root here (no rootless setup)");
    }
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let counter = match counter::build(t) {
        Ok(c) => c,
        Err(e) => return skip(&e),
    };

    // Host A: run, let it count, checkpoint (which stops the container).
    let (bundle_a, out_a) = (t.join("a/bundle"), t.join("a/out"));
    bundle(&flavor.bin, &bundle_a, &counter, &out_a);
    let mut host_a = Runsc { bin: flavor.bin.clone(), root: t.join("a/runsc"), ids: vec![] };
    let id_a = format!("snapctl-counter-a-{}", std::process::id());
    let r = host_a.start(&id_a, &["run", "-detach", "--bundle", bundle_a.to_str().unwrap(), &id_a]);
    if r.code != 0 {
        return skip(&format!("runsc run failed (ptrace platform unavailable?): {}", r.stderr.trim()));
    }
    let progress_a = out_a.join("progress");
    let early = wait_for_count(&progress_a, 5, "host A before checkpoint");
    assert_eq!(early.sum, early.sum0, "the counter's heap changed under it before any checkpoint");
    let ckpt = t.join("a/ckpt");
    std::fs::create_dir_all(&ckpt).unwrap();
    let r = run(host_a.cmd().arg("checkpoint").args(flavor.checkpoint).arg("--image-path").arg(&ckpt).arg(&id_a));
    assert_eq!(r.code, 0, "runsc checkpoint: {}", r.stderr);
    let mut written: Vec<String> = std::fs::read_dir(&ckpt).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    written.sort();
    let mut want: Vec<String> = flavor.files.iter().map(|(f, _)| f.to_string()).collect();
    want.sort();
    assert_eq!(written, want, "runsc checkpoint wrote other files than expected");
    let at_checkpoint = ticks(&progress_a).last().cloned().expect("ticks before checkpoint");
    let digests: Vec<(String, String)> = flavor.files.iter().map(|(f, _)| (f.to_string(), sha256_file(&ckpt.join(f)))).collect();

    // Push to a registry, then the container goes away for good.
    let s = Serve::start(t.join("store").to_str().unwrap(), &[], &[]);
    let reference = format!("{}/sandboxes/counter:v1", s.addr);
    let r = run(snapctl().arg("push").arg(&ckpt).arg(&reference).args(flavor.push).arg("--cache").arg(t.join("a/cache")));
    assert_eq!(r.code, 0, "snapctl push: {}{}", r.stdout, r.stderr);
    assert!(r.stdout.trim().starts_with("sha256:"), "push prints the manifest digest: {}", r.stdout);
    let r = run(host_a.cmd().args(["delete", "-force", &id_a]));
    assert_eq!(r.code, 0, "runsc delete: {}", r.stderr);

    // The image knows what each file is.
    let r = run(snapctl().arg("inspect").arg(&reference).arg("--json"));
    assert_eq!(r.code, 0, "snapctl inspect: {}", r.stderr);
    let v: serde_json::Value = serde_json::from_str(&r.stdout).expect("inspect --json");
    assert_eq!(v["kind"], "gvisor", "inspect: {v}");
    for (file, role) in flavor.files {
        let f = v["files"].as_array().unwrap().iter().find(|f| f["name"] == *file).unwrap_or_else(|| panic!("{file} not in the image: {v}"));
        assert_eq!(f["role"], *role, "{file}: {f}");
    }

    // Host B: its own cache, directories and runsc root; pull, restore.
    let restored = t.join("b/ckpt");
    let r = run(snapctl().arg("pull").arg(&reference).arg(&restored).arg("--cache").arg(t.join("b/cache")));
    assert_eq!(r.code, 0, "snapctl pull: {}{}", r.stdout, r.stderr);
    for (file, digest) in &digests {
        assert_eq!(&sha256_file(&restored.join(file)), digest, "pulled {file} differs");
    }
    let (bundle_b, out_b) = (t.join("b/bundle"), t.join("b/out"));
    bundle(&flavor.bin, &bundle_b, &counter, &out_b);
    let mut host_b = Runsc { bin: flavor.bin.clone(), root: t.join("b/runsc"), ids: vec![] };
    let id_b = format!("snapctl-counter-b-{}", std::process::id());
    let r = host_b.start(&id_b, &["restore", "-detach", "--image-path", restored.to_str().unwrap(), "--bundle", bundle_b.to_str().unwrap(), &id_b]);
    assert_eq!(r.code, 0, "runsc restore: {}", r.stderr);

    // The restored program writes into host B's output directory, continuing the count.
    let progress_b = out_b.join("progress");
    counter::assert_continued(&progress_b, 0, &at_checkpoint, "host B after restore");
}
