//! CRIU lazy restore (issue 5, "a second handshake"): `fake_criu`, a runtime that dumps and
//! restores like `criu dump` / `criu restore --lazy-pages`, against `snapctl lazy
//! --criu-workdir`, which plays `criu lazy-pages`.
//!
//! Needs root (or vm.unprivileged_userfaultfd=1) for userfaultfd with kernel faults;
//! without it the tests print a skip note, and with SNAPCTL_REQUIRE_PEERS=1 fail. Dumps are
//! 2-4 MiB per task so each test takes a few seconds. The same daemon against a real
//! `criu restore --lazy-pages` is in `criu.rs`.

use std::fs;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use imgfmt::{BlobSource, Image, OciLayout, StoredAt};
use serde_json::Value;
use snapctl_tests::registry_support::Serve;
use snapctl_tests::{require_peers, run, snapctl, uffd_usable};

use crate::lazy::Handler;

/// Whether the `snapctl` under test has `lazy --criu-workdir`.
pub(crate) fn criu_lazy_available() -> bool {
    let out = snapctl().args(["lazy", "--help"]).output();
    let ok = out.is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("--criu-workdir"));
    assert!(ok || !require_peers(), "`snapctl lazy --criu-workdir` is required (SNAPCTL_REQUIRE_PEERS=1)");
    if !ok {
        eprintln!("SKIP: snapctl lazy has no --criu-workdir");
    }
    ok
}

fn fake_criu() -> Command {
    Command::new(env!("CARGO_BIN_EXE_fake_criu"))
}

/// Dump tasks `(pid, size, extra args)` into `dir/dump`, pack it into `dir/layout`: the
/// dump directory, the layout reference and the dump summaries.
fn packed_dump(dir: &Path, tasks: &[(i32, &str, &[&str])]) -> (PathBuf, String, Vec<Value>) {
    let dump = dir.join("dump");
    let mut sums = Vec::new();
    for (pid, size, extra) in tasks {
        let r = run(fake_criu().arg("dump").arg(&dump).args(["--size", size, "--seed", "9", "--pid", &pid.to_string()]).args(*extra));
        assert_eq!(r.code, 0, "{r:?}");
        sums.push(serde_json::from_str(r.stdout.trim()).expect("dump summary"));
    }
    let reference = format!("oci:{}:v1", dir.join("layout").display());
    let r = run(snapctl().arg("pack").arg(&dump).arg(&reference));
    assert_eq!(r.code, 0, "{r:?}");
    (dump, reference, sums)
}

/// `fake_criu restore`: exit code and JSON summary.
fn restore(workdir: &Path, dump: &Path, pids: &[i32], extra: &[&str]) -> (i32, Value, String) {
    let mut cmd = fake_criu();
    cmd.arg("restore").arg("--workdir").arg(workdir).arg("--images").arg(dump).args(["--json", "--timeout", "30"]);
    for p in pids {
        cmd.args(["--pid", &p.to_string()]);
    }
    let r = run(cmd.args(extra));
    (r.code, serde_json::from_str(r.stdout.trim()).unwrap_or(Value::Null), r.stderr)
}

fn n(v: &Value, path: &[&str]) -> u64 {
    let mut x = v;
    for p in path {
        x = &x[*p];
    }
    x.as_u64().unwrap_or_else(|| panic!("{path:?} is not a number in {v}"))
}

pub(crate) fn report_of(reps: &[Value], pid: i32) -> &Value {
    reps.iter().find(|r| r["pid"].as_i64() == Some(pid as i64)).unwrap_or_else(|| panic!("no report for pid {pid}: {reps:?}"))
}

/// Stored bytes of a file of the image (what fetching each of its chunks once costs).
fn stored_bytes(layout: &Path, name: &str) -> u64 {
    let l = OciLayout::open(layout).unwrap();
    let image = Image::open(&l, &l.resolve_tag("v1").unwrap()).unwrap();
    let f = image.file(name).unwrap_or_else(|| panic!("{name} in the image")).1;
    f.chunks
        .iter()
        .map(|c| match c.at {
            StoredAt::Pack { stored_len, .. } => stored_len as u64,
            StoredAt::Zero => 0,
        })
        .sum()
}

/// A task ended well: every page pushed, or the task exited (its memory went) first.
fn assert_served(rep: &Value) {
    let ended = rep["ended"].as_str().unwrap_or_default();
    assert!(ended == "all pages installed" || ended == "the task's memory is gone", "{rep}");
}

/// Two tasks (and a zombie) on one connection, as criu restore sends them: every page of
/// every VMA right (data from pages-<id>.img, zeros for holes and non-present entries,
/// also across two adjacent VMAs one entry covers), every zero page served as a zero fault
/// with nothing fetched for it, each pages chunk fetched at most once, and the daemon exits
/// by itself once the rest is pushed after RESTORE_FINISHED.
#[test]
fn criu_lazy_restore_two_tasks_every_page_right() {
    if !uffd_usable() || !criu_lazy_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (dump, image, sums) = packed_dump(dir.path(), &[(11, "4MiB", &[]), (12, "2MiB", &[])]);
    let work = dir.path().join("work");
    // A slow push so the tasks' touches are served by faults, not by the push.
    let mut d = Handler::criu(&image, &work, &["--no-cache", "--prefetch-rate", "1MiB"]);
    let (code, j, err) = restore(&work, &dump, &[11, 12], &["--zombie", "99", "--threads", "4"]);
    assert_eq!(code, 0, "fake_criu: {j}\n{err}");
    let vma_pages: u64 = sums.iter().map(|s| n(s, &["vma_pages"])).sum();
    let present: u64 = sums.iter().map(|s| n(s, &["present_pages"])).sum();
    assert_eq!(n(&j, &["pages_checked"]), vma_pages, "{j}");
    assert_eq!((n(&j, &["mismatches"]), n(&j, &["poisoned"])), (0, 0), "{j}");
    assert_eq!(n(&j, &["zero_pages_seen"]), vma_pages - present, "{j}");
    let (code, reps) = d.finish(Duration::from_secs(60));
    assert_eq!(code, 0, "{}", d.log_text());
    assert_eq!(reps.len(), 2, "one report per task, none for the zombie: {reps:?}");
    assert!(d.log_text().contains("pid 99 is a zombie"), "{}", d.log_text());
    let (mut zero_faults, mut fetched_faults) = (0, 0);
    for (pid, sum) in [(11, &sums[0]), (12, &sums[1])] {
        let rep = report_of(&reps, pid);
        // The push is slow: the task usually exits (its memory goes) before it is done.
        assert_served(rep);
        assert_eq!(n(rep, &["present_pages"]), n(sum, &["present_pages"]), "{rep}");
        assert_eq!(n(rep, &["lazy_pages"]), n(sum, &["lazy_pages"]), "{rep}");
        assert_eq!((n(rep, &["verify_failures"]), n(rep, &["poisoned_pages"])), (0, 0), "{rep}");
        // A task's faults come from the image: fetched, or from the chunk cache another
        // task's faults or the prefetch filled first (which of the two is timing).
        assert!(n(rep, &["faults", "fetched"]) + n(rep, &["faults", "cache_hit"]) > 0, "faults were served from the image: {rep}");
        fetched_faults += n(rep, &["faults", "fetched"]);
        let stored = stored_bytes(&dir.path().join("layout"), &format!("pages-{pid}.img"));
        // Slices fetched before their chunk went whole (issue 16 §3) are counted apart.
        assert!(n(rep, &["bytes_fetched"]) - n(rep, &["slice_bytes"]) <= stored, "each chunk fetched whole at most once ({stored} stored): {rep}");
        zero_faults += n(rep, &["faults", "zero"]);
    }
    // Zero pages are zero faults (UFFDIO_ZEROPAGE), never a fetch: the pages files hold no
    // zero chunks, so every zero the tasks read came from a zero fault.
    assert_eq!(zero_faults, vma_pages - present, "{reps:?}");
    assert!(fetched_faults > 0, "some fault fetched from the image: {reps:?}");
}

/// The same through `snapctl serve`: pagemap and pages come over HTTP, verified.
#[test]
fn criu_lazy_restore_through_snapctl_serve() {
    if !uffd_usable() || !criu_lazy_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (dump, layout_ref, _) = packed_dump(dir.path(), &[(21, "4MiB", &[])]);
    let serve = Serve::start(dir.path().join("storage").to_str().unwrap(), &[], &[]);
    let image = format!("{}/sandboxes/criu:v1", serve.addr);
    let r = run(snapctl().args(["push", &layout_ref, &image]));
    assert_eq!(r.code, 0, "push: {r:?}");
    let work = dir.path().join("work");
    let mut d = Handler::criu(&image, &work, &["--no-cache"]);
    let (code, j, err) = restore(&work, &dump, &[21], &[]);
    assert_eq!(code, 0, "fake_criu: {j}\n{err}");
    let (code, reps) = d.finish(Duration::from_secs(60));
    assert_eq!(code, 0, "{}", d.log_text());
    let rep = report_of(&reps, 21);
    assert_served(rep);
    assert!(n(rep, &["bytes_fetched"]) > 0, "{rep}");
    assert_eq!(n(rep, &["verify_failures"]), 0, "{rep}");
}

/// A flipped byte in a pack holding a chunk of pages-<id>.img: the task never reads a wrong
/// byte (the chunk's pages are poisoned), and the daemon reports the failure (exit 1).
#[test]
fn criu_lazy_restore_of_tampered_pages_chunk_never_shows_wrong_bytes() {
    if !uffd_usable() || !criu_lazy_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (dump, image_ref, _) = packed_dump(dir.path(), &[(31, "4MiB", &[])]);
    snapctl_tests::tamper_first_stored_chunk(&dir.path().join("layout"), "v1", "pages-31.img");

    let work = dir.path().join("work");
    let mut d = Handler::criu(&image_ref, &work, &["--no-cache"]);
    let (code, j, err) = restore(&work, &dump, &[31], &[]);
    assert_eq!(n(&j, &["mismatches"]), 0, "no wrong byte ever reaches the task: {j}\n{err}");
    assert!(n(&j, &["poisoned"]) > 0, "the bad chunk's pages are poisoned: {j}");
    assert_eq!(code, 3, "no wrong byte, but not a clean restore: {j}");
    let (code, reps) = d.finish(Duration::from_secs(60));
    assert_eq!(code, 1, "poisoned: exit 1: {}", d.log_text());
    let rep = report_of(&reps, 31);
    assert!(n(rep, &["verify_failures"]) >= 1, "{rep}");
    assert!(n(rep, &["poisoned_pages"]) >= 1, "{rep}");
    assert!(d.log_text().contains("VERIFY FAILURE"), "{}", d.log_text());
}

/// Pages in a parent dump (PE_PARENT) are not served from anywhere: the task gets poison
/// there (never zeros), everything else is right, and the daemon says why (exit 2).
#[test]
fn criu_lazy_restore_poisons_parent_pages() {
    if !uffd_usable() || !criu_lazy_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (dump, image, sums) = packed_dump(dir.path(), &[(41, "2MiB", &["--parent-pages", "3"])]);
    let parent = n(&sums[0], &["parent_pages"]);
    assert!(parent > 0, "{:?}", sums);
    let work = dir.path().join("work");
    let mut d = Handler::criu(&image, &work, &["--no-cache"]);
    let (code, j, err) = restore(&work, &dump, &[41], &[]);
    assert_eq!(code, 0, "fake_criu: {j}\n{err}");
    assert_eq!(n(&j, &["parent_poisoned"]), parent, "{j}");
    assert_eq!((n(&j, &["mismatches"]), n(&j, &["poisoned"])), (0, 0), "{j}");
    let (code, reps) = d.finish(Duration::from_secs(60));
    assert_eq!(code, 2, "a task not fully served: exit 2: {}", d.log_text());
    let rep = report_of(&reps, 41);
    assert!(rep["error"].as_str().is_some_and(|e| e.contains("PE_PARENT")), "{rep}");
    assert_eq!(n(rep, &["parent_pages"]), parent, "{rep}");
    assert_eq!(n(rep, &["poisoned_pages"]), parent, "{rep}");
}

/// The runtime's check can fail: told to expect pages that differ from the image's, it sees
/// the daemon's (right) bytes as wrong and says so (exit 1, mismatches counted).
#[test]
fn fake_criu_sees_wrong_bytes() {
    if !uffd_usable() || !criu_lazy_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (dump, image, _) = packed_dump(dir.path(), &[(51, "2MiB", &[])]);
    let pages = dump.join("pages-51.img");
    let f = fs::OpenOptions::new().read(true).write(true).open(&pages).unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, 5000).unwrap();
    f.write_all_at(&[b[0] ^ 1], 5000).unwrap();
    drop(f);
    let work = dir.path().join("work");
    let mut d = Handler::criu(&image, &work, &["--no-cache"]);
    let (code, j, err) = restore(&work, &dump, &[51], &[]);
    assert_eq!(code, 1, "a wrong byte means exit 1: {j}\n{err}");
    assert_eq!(n(&j, &["mismatches"]), 1, "{j}");
    assert_eq!(d.finish(Duration::from_secs(60)).0, 0, "{}", d.log_text());
}

/// A restore that breaks off before RESTORE_FINISHED (criu restore failed): the daemon
/// releases the task and exits 2, saying why.
#[test]
fn criu_restore_that_breaks_off_is_an_error() {
    if !uffd_usable() || !criu_lazy_available() {
        return;
    }
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    use std::io::{IoSlice, Write};
    use std::os::fd::AsRawFd;
    let dir = tempfile::tempdir().unwrap();
    let (_dump, image, _) = packed_dump(dir.path(), &[(61, "1MiB", &[])]);
    let work = dir.path().join("work");
    let mut d = Handler::criu(&image, &work, &["--no-cache"]);
    let s = std::os::unix::net::UnixStream::connect(work.join("lazy-pages.socket")).unwrap();
    // A real userfaultfd with nothing registered: the task's memory is never touched.
    let uffd = userfaultfd::UffdBuilder::new().close_on_exec(true).non_blocking(true).user_mode_only(false).create().unwrap();
    (&s).write_all(&61i32.to_ne_bytes()).unwrap();
    sendmsg::<()>(s.as_raw_fd(), &[IoSlice::new(&[0])], &[ControlMessage::ScmRights(&[uffd.as_raw_fd()])], MsgFlags::empty(), None).unwrap();
    drop(s);
    let (code, reps) = d.finish(Duration::from_secs(30));
    assert_eq!(code, 2, "{}", d.log_text());
    assert_eq!(report_of(&reps, 61)["ended"], "the restore failed or was stopped", "{reps:?}");
    assert!(d.log_text().contains("before it finished"), "{}", d.log_text());
}

/// `--criu-prepare` then SIGTERM before any restore connected: the daemon stops waiting,
/// exits 0, and removes the files it prepared (their lazy pages are holes: left behind, a
/// plain `criu restore` of them would read zeros).
#[test]
fn sigterm_before_the_restore_removes_the_prepared_dump() {
    if !criu_lazy_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (_dump, reference, _) = packed_dump(dir.path(), &[(4242, "2MiB", &[])]);
    let work = dir.path().join("work");
    let mut d = Handler::criu(&reference, &work, &["--criu-prepare", "--no-cache"]);
    assert!(work.join("pagemap-4242.img").is_file(), "{}", d.log_text());
    // SAFETY: kill with a pid and a signal number touches no memory.
    assert_eq!(unsafe { libc::kill(d.child.id() as i32, libc::SIGTERM) }, 0);
    let (code, reps) = d.finish(Duration::from_secs(10));
    assert_eq!(code, 0, "{reps:?} {}", d.log_text());
    let left: Vec<_> = fs::read_dir(&work)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".img") || n.ends_with(".socket"))
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}
