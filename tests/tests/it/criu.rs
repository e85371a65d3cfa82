//! Real CRIU round trips: issue 4's "Real runtimes" (`criu dump`, `snapctl push`, `snapctl
//! pull` on a second "host", `criu restore`) and issue 5's "second handshake" (`criu restore
//! --lazy-pages` with `snapctl lazy --criu-workdir` serving the memory).
//!
//! The criu is 4.x from Debian trixie, unpacked with its own glibc by
//! `scripts/install-trixie.sh criu` (Debian bookworm's criu 3.17 cannot dump on this kernel);
//! tests find it as `$SNAPCTL_CRIU`, else `/opt/snapctl-criu/criu`. The program is
//! `tests/runtimes/counter.c`, run as its own session with no terminal (what `criu dump`
//! takes without `--shell-job`). Skips loudly without criu, gcc, root or userfaultfd; with
//! `SNAPCTL_REQUIRE_PEERS=1` those are failures.

use std::fs;
use std::os::unix::fs::FileExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use lazy::pagemap::decode_pagemap;
use snapctl_tests::counter::{self, sha256_file, ticks, Tick};
use snapctl_tests::registry_support::Serve;
use snapctl_tests::{require_peers, run, snapctl, uffd_usable};
use tempfile::TempDir;

use crate::lazy::Handler;
use crate::lazy_criu::{criu_lazy_available, report_of};

fn skip(why: &str) {
    assert!(!require_peers(), "the CRIU round trip cannot run (SNAPCTL_REQUIRE_PEERS=1): {why}");
    eprintln!("SKIP: CRIU round trip: {why}");
}

/// A criu that works here, or why not.
fn find_criu() -> Result<PathBuf, String> {
    // SAFETY: geteuid has no preconditions and touches no memory.
    if unsafe { libc::geteuid() } != 0 {
        return Err("criu needs root".into());
    }
    let bin = std::env::var_os("SNAPCTL_CRIU").map(PathBuf::from).unwrap_or_else(|| "/opt/snapctl-criu/criu".into());
    if !bin.exists() {
        return Err(format!("no criu at {} (run `bash scripts/install-trixie.sh criu`, or set SNAPCTL_CRIU)", bin.display()));
    }
    let r = run(Command::new(&bin).arg("check"));
    if r.code != 0 {
        return Err(format!("`{} check` failed: {}{}", bin.display(), r.stdout, r.stderr));
    }
    Ok(bin)
}

/// The counter, started as a session leader with stdio on /dev/null. Killed on drop, and
/// so is whatever criu restored under its pid (criu restores a task with its old pid, as
/// a child of criu that is reparented when `criu restore -d` exits).
struct Counter {
    child: Option<Child>,
    pid: i32,
    exe: PathBuf,
}

impl Counter {
    fn start(exe: &Path, progress: &Path, args: &[&str]) -> Counter {
        let mut cmd = Command::new(exe);
        cmd.arg(progress).args(args).current_dir(exe.parent().unwrap());
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
        // SAFETY: setsid is async-signal-safe and the closure touches nothing else.
        unsafe {
            cmd.pre_exec(|| {
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().expect("start the counter");
        Counter { pid: child.id() as i32, child: Some(child), exe: exe.to_path_buf() }
    }

    /// `criu dump` the counter into `dir` (which kills it; it is reaped here so criu can
    /// restore its pid). The last tick written before the dump, and how many lines that was.
    fn dump(&mut self, criu: &Path, dir: &Path, log: &Path, progress: &Path) -> (Tick, usize) {
        fs::create_dir_all(dir).unwrap();
        let r = run(Command::new(criu).args(["dump", "-t", &self.pid.to_string(), "-D"]).arg(dir).arg("-o").arg(log));
        assert_eq!(r.code, 0, "criu dump: {}\n{}", r.stderr, fs::read_to_string(log).unwrap_or_default());
        let st = self.child.take().unwrap().wait().unwrap();
        assert!(!st.success(), "the counter should have been killed by the dump, not exit: {st}");
        let earlier = ticks(progress);
        (earlier.last().cloned().expect("ticks before the dump"), earlier.len())
    }
}

impl Drop for Counter {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
            return;
        }
        // Only kill the pid if it is still (a restored copy of) our counter.
        let cmdline = fs::read(format!("/proc/{}/cmdline", self.pid)).unwrap_or_default();
        if cmdline.starts_with(self.exe.as_os_str().as_encoded_bytes()) {
            // SAFETY: kill with a pid and a signal number touches no memory.
            unsafe { libc::kill(self.pid, libc::SIGKILL) };
        }
    }
}

/// Host A's side of every test: the counter (run with `args`) counted to 5, dumped into
/// `a/dump` and pushed to a `snapctl serve`. Host B's work goes under `b/`.
struct Dumped {
    criu: PathBuf,
    /// Kills the restored copy on drop.
    counter: Counter,
    progress: PathBuf,
    /// The last tick before the dump, and how many lines the progress file had then.
    at: Tick,
    earlier: usize,
    reference: String,
    _serve: Serve,
    tmp: TempDir,
}

impl Dumped {
    /// `None` (after a loud skip, or a failure with SNAPCTL_REQUIRE_PEERS=1) when criu,
    /// gcc, or (for `lazy`) userfaultfd or `lazy --criu-workdir` is missing.
    fn new(args: &[&str], lazy: bool) -> Option<Dumped> {
        let criu = find_criu().map_err(|e| skip(&e)).ok()?;
        if lazy && (!uffd_usable() || !criu_lazy_available()) {
            return None;
        }
        let tmp = tempfile::tempdir().unwrap();
        let t = tmp.path();
        let exe = counter::build(t).map_err(|e| skip(&e)).ok()?;
        let progress = t.join("progress");
        let mut counter = Counter::start(&exe, &progress, args);
        counter::wait_for_count(&progress, 5, "the counter before its dump");
        let (at, earlier) = counter.dump(&criu, &t.join("a/dump"), &t.join("a/dump.log"), &progress);
        let serve = Serve::start(t.join("store").to_str().unwrap(), &[], &[]);
        let reference = format!("{}/sandboxes/criu-counter:v1", serve.addr);
        let r = run(snapctl().arg("push").arg(t.join("a/dump")).arg(&reference).arg("--cache").arg(t.join("a/cache")));
        assert_eq!(r.code, 0, "snapctl push: {}{}", r.stdout, r.stderr);
        Some(Dumped { criu, counter, progress, at, earlier, reference, _serve: serve, tmp })
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.tmp.path().join(rel)
    }

    /// `snapctl pull` of the image into `dest` with host B's cache.
    fn pull(&self, dest: &Path) {
        let r = run(snapctl().arg("pull").arg(&self.reference).arg(dest).arg("--cache").arg(self.path("b/cache")));
        assert_eq!(r.code, 0, "snapctl pull: {}{}", r.stdout, r.stderr);
    }

    /// `criu restore -d` from `dir` (with `extra` flags).
    fn restore(&self, dir: &Path, extra: &[&str]) {
        let busy = wait_for_free_pids(dir, Duration::from_secs(30));
        let log = self.path("b/restore.log");
        let r = run(Command::new(&self.criu).args(["restore", "-d", "-D"]).arg(dir).arg("-o").arg(&log).args(extra));
        assert_eq!(
            r.code,
            0,
            "criu restore: {}\n{}\npids of the dump still in use when restore began: {busy:?}",
            r.stderr,
            fs::read_to_string(&log).unwrap_or_default()
        );
    }

    /// The restored counter goes on from the dump with its heap intact.
    fn assert_continued(&self, what: &str) {
        counter::assert_continued(&self.progress, self.earlier, &self.at, what);
    }
}

/// CRIU restores every task under the pid it had (its `core-<pid>.img`), so a restore
/// fails ("Can't fork for N: File exists") if another process or thread took one of
/// them meanwhile. With this machine's pid_max of 32768 and the other tests' processes
/// and threads running beside this one, pids wrap within a test run, and a dumped
/// counter's forked child once found its pid taken. Wait (up to `limit`) until no pid of
/// the dump is in use; returns those still in use, for the failure message.
fn wait_for_free_pids(dir: &Path, limit: Duration) -> Vec<u32> {
    let pids: Vec<u32> = fs::read_dir(dir)
        .map(|rd| rd.filter_map(|e| e.ok()?.file_name().to_str()?.strip_prefix("core-")?.strip_suffix(".img")?.parse().ok()).collect())
        .unwrap_or_default();
    let t0 = std::time::Instant::now();
    loop {
        // /proc/<tid> exists for threads too, though readdir of /proc does not list them.
        let busy: Vec<u32> = pids.iter().copied().filter(|p| Path::new(&format!("/proc/{p}")).exists()).collect();
        if busy.is_empty() || t0.elapsed() > limit {
            return busy;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The wait sees a pid in use (this process's) and ignores one that is free and files
/// that are not a task's core image.
#[test]
fn pids_of_a_dump_in_use_are_found() {
    let dir = tempfile::tempdir().unwrap();
    let me = std::process::id();
    // pid_max here is 32768; a pid above 4194304 (the kernel's limit) is never in use.
    for name in [format!("core-{me}.img"), "core-4194400.img".into(), "pstree.img".into(), "core-x.img".into()] {
        fs::write(dir.path().join(name), b"").unwrap();
    }
    let t0 = std::time::Instant::now();
    assert_eq!(wait_for_free_pids(dir.path(), Duration::from_millis(300)), vec![me]);
    assert!(t0.elapsed() >= Duration::from_millis(300), "it waited for the pid to be free");
    fs::remove_file(dir.path().join(format!("core-{me}.img"))).unwrap();
    assert_eq!(wait_for_free_pids(dir.path(), Duration::from_secs(30)), Vec::<u32>::new());
}

/// Issue 4, "Real runtimes", CRIU: dump a running program, push it, pull it on a second
/// "host" (its own cache and directory), restore it there, and it goes on counting with
/// its heap intact.
#[test]
fn criu_dump_push_pull_restore_continues_the_counter() {
    let Some(d) = Dumped::new(&[], false) else { return };
    let pulled = d.path("b/dump");
    d.pull(&pulled);
    let mut names: Vec<_> = fs::read_dir(d.path("a/dump")).unwrap().map(|e| e.unwrap().file_name()).collect();
    names.sort();
    assert!(names.iter().any(|n| n.to_string_lossy().starts_with("pages-")), "criu wrote no pages image: {names:?}");
    for n in &names {
        assert_eq!(sha256_file(&pulled.join(n)), sha256_file(&d.path("a/dump").join(n)), "{n:?} differs after pull");
    }
    d.restore(&pulled, &[]);
    d.assert_continued("counter restored by criu from the pulled dump");
}

/// Issue 5, "A second handshake", with a real criu: `criu restore --lazy-pages` hands the
/// counter's userfaultfd to `snapctl lazy --criu-workdir`, which serves its memory from
/// the registry. To show the lazy pages really come from snapctl, the local
/// `pages-<id>.img` that criu restores from has every lazy page overwritten with garbage
/// first (criu itself reads only the non-lazy ones): the counter's heap checksum still
/// matches after restore. The same pull left cache references to that file, which are now
/// stale: they must miss, not serve the garbage.
#[test]
fn criu_lazy_pages_restore_served_by_snapctl_lazy() {
    let Some(d) = Dumped::new(&[], true) else { return };
    let work = d.path("b/dump");
    d.pull(&work);
    let pagemap_name = format!("pagemap-{}.img", d.counter.pid);
    let pm = decode_pagemap(&fs::read(work.join(&pagemap_name)).unwrap()).expect("criu's pagemap decodes");
    let pages = fs::OpenOptions::new().write(true).open(work.join(format!("pages-{}.img", pm.pages_id))).unwrap();
    let mut spoiled = 0u64;
    for run in pm.runs().iter().filter(|r| r.lazy) {
        pages.write_all_at(&vec![0xa5; run.len as usize], run.offset).unwrap();
        spoiled += run.len / 4096;
    }
    drop(pages);
    assert!(spoiled >= 2048, "the 8 MiB heap should be lazy pages; only {spoiled} spoiled");

    let mut daemon = Handler::criu(&d.reference, &work, &["--cache", d.path("b/cache").to_str().unwrap()]);
    d.restore(&work, &["--lazy-pages"]);
    d.assert_continued("counter restored lazily by criu + snapctl lazy");
    let (code, reps) = daemon.finish(Duration::from_secs(60));
    assert_eq!(code, 0, "snapctl lazy exit: {reps:?}\n{}", daemon.log_text());
    let rep = report_of(&reps, d.counter.pid);
    assert_eq!(rep["ended"], "all pages installed", "{rep}");
    assert_eq!(rep["pagemap"], pagemap_name.as_str(), "{rep}");
    assert_eq!(rep["lazy_pages"].as_u64(), Some(spoiled), "{rep}");
    assert_eq!(rep["verify_failures"].as_u64(), Some(0), "{rep}");
    assert_eq!(rep["poisoned_pages"].as_u64(), Some(0), "{rep}");
    assert!(rep["faults"]["total"].as_u64().unwrap() > 0, "criu's task faulted nothing through snapctl: {rep}");
}

/// The lazy workflow without a pull: `snapctl lazy --criu-prepare` writes the dump into an
/// empty work directory with every lazy page left a hole, criu restores from it with
/// `--lazy-pages`, and the counter's heap (all lazy pages) comes from the server. When the
/// daemon exits the prepared files are gone: they are not the dump on their own.
#[test]
fn criu_lazy_pages_restore_into_a_prepared_workdir() {
    let Some(d) = Dumped::new(&[], true) else { return };
    let work = d.path("b/work");
    let mut daemon = Handler::criu(&d.reference, &work, &["--criu-prepare", "--cache", d.path("b/cache").to_str().unwrap()]);
    let log = daemon.log_text();
    assert!(log.contains("of lazy pages left to serve"), "{log}");
    let pages = fs::read_dir(&work).unwrap().map(|e| e.unwrap().path()).find(|p| p.file_name().unwrap().to_string_lossy().starts_with("pages-"));
    let pages = pages.unwrap_or_else(|| panic!("no pages file prepared: {log}"));
    let (len, allocated) = {
        use std::os::unix::fs::MetadataExt as _;
        let m = fs::metadata(&pages).unwrap();
        (m.len(), m.blocks() * 512)
    };
    assert!(allocated * 4 < len, "the prepared {} should be mostly holes: {allocated} of {len} bytes allocated", pages.display());

    d.restore(&work, &["--lazy-pages"]);
    d.assert_continued("counter restored lazily from a prepared work dir");
    let (code, reps) = daemon.finish(Duration::from_secs(60));
    assert_eq!(code, 0, "snapctl lazy exit: {reps:?}\n{}", daemon.log_text());
    let rep = report_of(&reps, d.counter.pid);
    assert_eq!(rep["ended"], "all pages installed", "{rep}");
    assert!(rep["lazy_pages"].as_u64().unwrap() >= 2048, "{rep}");
    assert_eq!(rep["verify_failures"].as_u64(), Some(0), "{rep}");
    let left: Vec<_> = fs::read_dir(&work).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).filter(|n| n.ends_with(".img")).collect();
    assert!(left.is_empty(), "prepared files left after the daemon exited: {left:?}");
}

/// A restored task that forks before its pages have all been pushed: the child's
/// userfaultfd comes in a fork event, and the child's faults must be served too (closing
/// its uffd would let the kernel zero-fill the child's view of the heap). The counter,
/// run with "fork", forks a child every tick that checksums the heap and says whether it
/// matched; the push is slowed to 2 MiB/s so the first children after the restore find
/// most of the heap still missing.
#[test]
fn criu_lazy_restore_follows_forked_children() {
    let Some(d) = Dumped::new(&["fork"], true) else { return };
    let work = d.path("b/work");
    let mut daemon = Handler::criu(&d.reference, &work, &["--criu-prepare", "--prefetch-rate", "2MiB", "--cache", d.path("b/cache").to_str().unwrap()]);
    d.restore(&work, &["--lazy-pages"]);
    d.assert_continued("forking counter restored lazily");
    let (code, reps) = daemon.finish(Duration::from_secs(60));
    assert_eq!(code, 0, "snapctl lazy exit: {reps:?}\n{}", daemon.log_text());
    let lines: Vec<String> = fs::read_to_string(&d.progress).unwrap().lines().skip(d.earlier).map(str::to_string).collect();
    assert!(lines.iter().all(|l| l.ends_with(" child=ok")), "a forked child saw a wrong heap: {lines:#?}");
    let pid = d.counter.pid as i64;
    let children = reps.iter().filter(|r| r["forked_from"].as_i64() == Some(pid)).count();
    assert!(children >= 1, "no forked child was followed: {reps:?}\n{}", daemon.log_text());
    let faulted: u64 = reps.iter().filter(|r| r["forked_from"].is_i64()).map(|r| r["faults"]["total"].as_u64().unwrap()).sum();
    assert!(faulted > 0, "the children faulted nothing through snapctl (was the push too fast?): {reps:?}");
}
