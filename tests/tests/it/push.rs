//! `snapctl push`, `copy`, `login` and the registry client's write half (issue 4, push
//! side), against `snapctl serve` and Debian's docker-registry (distribution 2.8: no
//! referrers API, so referrers go through the fallback tag).

use std::collections::BTreeMap;
use std::fs;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use imgfmt::{BlobSource, OciDigest};
use regclient::RegistrySource;
use snapctl_tests::registry_support::{htpasswd, Distribution, Serve};
use snapctl_tests::{have, run, Work};

const MIB: u64 = 1 << 20;

/// Steps of these tests beside [`Work`]'s own.
trait PushWork {
    /// A copy of snapshot `from` with `k` blocks rewritten (`sample --mutate` works in place).
    fn mutated(&self, from: &Path, name: &str, size: &str, k: u32) -> PathBuf;
    /// Push with `--json`; the report.
    fn push(&self, src: &str, dest: &str, extra: &[&str]) -> serde_json::Value;
}

impl PushWork for Work {
    fn mutated(&self, from: &Path, name: &str, size: &str, k: u32) -> PathBuf {
        let p = self.path(name);
        let r = run(std::process::Command::new("cp").args(["-a", "--sparse=always"]).arg(from).arg(&p));
        assert_eq!(r.code, 0, "{r:?}");
        self.ok(&["sample", p.to_str().unwrap(), "--size", size, "--mutate", &k.to_string()]);
        p
    }
    fn push(&self, src: &str, dest: &str, extra: &[&str]) -> serde_json::Value {
        let mut args = vec!["push", src, dest, "--json"];
        args.extend_from_slice(extra);
        let r = self.ok(&args);
        serde_json::from_str(&r.stdout).unwrap_or_else(|e| panic!("push --json printed no JSON ({e}): {r:?}"))
    }
}

fn n(v: &serde_json::Value, k: &str) -> u64 {
    v[k].as_u64().unwrap_or_else(|| panic!("{k} missing in {v}"))
}

fn same_files(a: &Path, b: &Path) {
    for name in ["vm.mem", "vm.state"] {
        let (x, y) = (fs::read(a.join(name)).unwrap(), fs::read(b.join(name)).unwrap());
        assert!(x == y, "{name} differs between {} and {}", a.display(), b.display());
    }
}

/// The whole push story through one registry: push, copy back (same digest), unpack the
/// registry reference (byte-identical), re-push (nothing sent), a layer with k changed
/// chunks (about k chunks sent, parent's packs mounted from the base repository).
fn push_story(addr: &str) {
    let w = Work::new();
    let snap = w.sample("snap", "32MiB");
    let lay = w.path("layout");
    let v1 = w.ok(&["pack", snap.to_str().unwrap(), &format!("oci:{}:v1", lay.display())]).stdout.trim().to_string();

    let base = format!("{addr}/vm/base:v1");
    let rep = w.push(&format!("oci:{}:v1", lay.display()), &base, &[]);
    assert_eq!(rep["manifest"], v1.as_str());
    assert!(n(&rep, "uploaded_blobs") >= 3, "{rep}");
    assert_eq!(n(&rep, "bytes_sent"), n(&rep, "bytes_total"), "first push sends every blob: {rep}");
    assert!(n(&rep, "deduplicated_chunks") >= 8, "zero chunks are never sent: {rep}");

    // Copy back into a fresh layout: same manifest digest, verifies.
    let back = w.path("back");
    let r = w.ok(&["copy", &base, &format!("oci:{}:v1", back.display())]);
    assert_eq!(r.stdout.trim(), v1);
    w.ok(&["verify", &format!("oci:{}:v1", back.display())]);
    // Unpack straight from the registry: byte-identical to the snapshot.
    let out = w.path("out");
    w.ok(&["unpack", &base, out.to_str().unwrap()]);
    same_files(&snap, &out);

    // Unchanged: only HEADs.
    let again = w.push(&format!("oci:{}:v1", lay.display()), &base, &[]);
    assert_eq!((n(&again, "bytes_sent"), n(&again, "uploaded_blobs")), (0, 0), "{again}");
    assert_eq!(n(&again, "skipped_blobs"), n(&again, "blobs"));

    // A layer with 3 changed 1 MiB chunks, pushed to another repository: the parent's
    // packs are mounted from vm/base (known from the first push), 3 chunks go up.
    let snap2 = w.mutated(&snap, "snap2", "32MiB", 3);
    w.ok(&["pack", snap2.to_str().unwrap(), &format!("oci:{}:v2", lay.display()), "--parent", &format!("oci:{}:v1", lay.display())]);
    let next = format!("{addr}/vm/next:v2");
    let rep2 = w.push(&format!("oci:{}:v2", lay.display()), &next, &[]);
    assert!(n(&rep2, "mounted_blobs") >= 1, "parent's pack mounted: {rep2}");
    let sent = n(&rep2, "bytes_sent");
    assert!((3 * MIB..4 * MIB).contains(&sent), "3 changed chunks, plus metadata, sent: {sent} bytes: {rep2}");
    let out2 = w.path("out2");
    w.ok(&["unpack", &next, out2.to_str().unwrap()]);
    same_files(&snap2, &out2);
}

#[test]
fn push_story_snapctl_serve() {
    let store = tempfile::tempdir().unwrap();
    let s = Serve::start(store.path().to_str().unwrap(), &[], &[]);
    push_story(&s.addr);
}

#[test]
fn push_story_docker_registry() {
    if !have("docker-registry") {
        return;
    }
    let store = tempfile::tempdir().unwrap();
    let d = Distribution::start(store.path());
    push_story(&d.addr);
}

/// `push DIR` sends each pack as soon as it is sealed, while the next is packed: with
/// several packs the report still counts every blob as uploaded by this push (none was
/// "already there" for the copy that follows), the registry has the whole image, and it
/// pulls back byte-identical.
#[test]
fn push_directory_sends_packs_while_packing() {
    let store = tempfile::tempdir().unwrap();
    let s = Serve::start(store.path().to_str().unwrap(), &[], &[]);
    let w = Work::new();
    let snap = w.sample("snap", "24MiB");
    let dest = format!("{}/vm/ahead:v1", s.addr);
    let rep = w.push(snap.to_str().unwrap(), &dest, &["--pack-size", "2MiB"]);
    assert!(n(&rep, "blobs") >= 6, "several packs: {rep}");
    assert_eq!(n(&rep, "uploaded_blobs"), n(&rep, "blobs"), "{rep}");
    assert_eq!(n(&rep, "skipped_blobs"), 0, "{rep}");
    assert_eq!(n(&rep, "bytes_sent"), n(&rep, "bytes_total"), "{rep}");
    assert!(n(&rep, "bytes_read") >= n(&rep, "bytes_sent"), "packs sent ahead count as read: {rep}");
    let (total, pack) = (rep["seconds"].as_f64().unwrap(), rep["pack"]["seconds"].as_f64().unwrap());
    assert!(total >= pack, "the push's seconds include packing (and the sends during it): {rep}");
    let out = w.path("pulled");
    w.ok(&["pull", &dest, out.to_str().unwrap()]);
    same_files(&snap, &out);
}

/// `push DIR`: packed on the fly; the second push of the unchanged directory sends no
/// blob bytes (the earlier manifest is reused, though packing again would stamp a new
/// creation time). Also `--mount-from` naming the repository explicitly.
#[test]
fn push_directory_twice_sends_nothing_the_second_time() {
    let store = tempfile::tempdir().unwrap();
    let s = Serve::start(store.path().to_str().unwrap(), &[], &[]);
    let w = Work::new();
    let snap = w.sample("snap", "16MiB");
    let dest = format!("{}/vm/dir:v1", s.addr);
    let first = w.push(snap.to_str().unwrap(), &dest, &[]);
    assert!(n(&first, "bytes_sent") > 4 * MIB, "{first}");
    let second = w.push(snap.to_str().unwrap(), &dest, &[]);
    assert_eq!(second["manifest"], first["manifest"]);
    assert_eq!(n(&second, "bytes_sent"), 0, "{second}");
    // Another repository, told where to mount from, with a fresh cache (no record).
    let w2 = Work::new();
    let lay = w2.path("l");
    w2.ok(&["pack", snap.to_str().unwrap(), &format!("oci:{}:x", lay.display())]);
    let rep = w2.push(&format!("oci:{}:x", lay.display()), &format!("{}/vm/other:x", s.addr), &["--mount-from", "vm/dir"]);
    assert!(n(&rep, "mounted_blobs") >= 1, "{rep}");
    assert!(n(&rep, "bytes_sent") < MIB, "only the new config and index: {rep}");
}

/// What a `push_dir` observer was told.
#[derive(Default)]
struct Seen {
    scanned: AtomicU64,
    packed: AtomicU64,
    uploaded: AtomicU64,
    /// The last upload total.
    total: AtomicU64,
    /// At `packing_done`: the bytes packed, and the upload total.
    at_packing_done: Mutex<Option<(u64, u64)>>,
    /// The parent notes, in order: `taken <reference>`, `not taken …`, `none: why`.
    parents: Mutex<Vec<String>>,
}

impl pusher::PushObserver for Seen {
    fn scanned(&self, scan: &pusher::DirScan) {
        self.scanned.store(scan.total_bytes(), Relaxed);
    }
    fn parent(&self, note: &pusher::ParentNote<'_>) {
        let line = match note {
            pusher::ParentNote::Taken { reference, .. } => format!("taken {reference}"),
            pusher::ParentNote::NotTaken { reference, why } => format!("not taken {reference}: {why}"),
            pusher::ParentNote::None { why } => format!("none: {why}"),
        };
        self.parents.lock().unwrap().push(line);
    }
    fn packed(&self, n: u64) {
        self.packed.fetch_add(n, Relaxed);
    }
    fn packing_done(&self, _: Option<pusher::Reused>, _: Option<&pusher::PackReport>) {
        *self.at_packing_done.lock().unwrap() = Some((self.packed.load(Relaxed), self.total.load(Relaxed)));
    }
    fn upload_total(&self, bytes: u64) {
        self.total.store(bytes, Relaxed);
    }
    fn uploaded(&self, n: u64) {
        self.uploaded.fetch_add(n, Relaxed);
    }
}

/// `pusher::push_dir` of `snap` to `dest` as `tag` (the closest image of the repository as
/// the parent, packs of 2 MiB, the work area's cache), walking the directory once here:
/// the report, what the observer saw, and the walks the push itself made (0 expected).
fn push_dir_lib(w: &Work, snap: &Path, dest: &RegistrySource, tag: &str) -> (pusher::PushDirReport, Seen, u64) {
    let scan = pusher::DirScan::take(snap).unwrap();
    let walks = pusher::scan::walks_on_this_thread();
    let opts = pusher::DirOptions {
        pack: pusher::PackOptions { pack_size: 2 * MIB, ..Default::default() },
        options_key: "library test".into(),
        cache_dir: w.path("cache"),
        closest: Some(pusher::closest::DEFAULT_CANDIDATES),
    };
    let copy = pusher::CopyOptions { upload: regclient::UploadOptions { cache_dir: Some(w.path("cache")), ..Default::default() }, ..Default::default() };
    let seen = Seen::default();
    let report = pusher::push_dir(&scan, dest, tag, opts, &copy, &seen).unwrap();
    (report, seen, pusher::scan::walks_on_this_thread() - walks)
}

/// Push is a library call (issue 15): `pusher::push_dir` packs a directory into the
/// cache, sends its packs while packing and PUTs the manifest, with no binary involved;
/// a second call on the unchanged directory sends nothing, and the image pulls back
/// byte-identical.
#[test]
fn push_dir_is_a_library_call() {
    let store = tempfile::tempdir().unwrap();
    let s = Serve::start(store.path().to_str().unwrap(), &[], &[]);
    let w = Work::new();
    let snap = w.sample("snap", "8MiB");
    let dest = RegistrySource::new(&s.addr, "vm/lib", true, None).unwrap();
    let (first, seen, _) = push_dir_lib(&w, &snap, &dest, "v1");
    let first = first.push;
    assert!(first.blobs >= 4, "several packs, index, config, outboard: {first:?}");
    assert_eq!(first.uploaded_blobs, first.blobs, "{first:?}");
    assert_eq!(first.pack.as_ref().map(|p| p.skipped), Some(false), "{first:?}");
    assert_eq!(dest.resolve_tag("v1").unwrap().to_string(), first.manifest);
    assert_eq!(seen.parents.lock().unwrap().len(), 1, "the closest image was looked for: none yet");
    let (second, _, _) = push_dir_lib(&w, &snap, &dest, "v1");
    let second = second.push;
    assert_eq!(second.manifest, first.manifest, "unchanged directory, same image");
    assert_eq!((second.bytes_sent, second.uploaded_blobs), (0, 0), "{second:?}");
    let out = w.path("pulled");
    w.ok(&["pull", &format!("{}/vm/lib:v1", s.addr), out.to_str().unwrap()]);
    same_files(&snap, &out);
}

/// Issue 36: `push DIR` listed the directory four times (the checks, the closest image's
/// search, the stamp before and after packing, the packer). Now one walk is handed to
/// every step: a first push (no image in the repository), a push of the changed
/// directory (the closest image found, sampled and taken; stamped, packed, stamped
/// again) and one of the unchanged directory (the stamp) each walk it only when the
/// caller takes the scan.
#[test]
fn regression_issue_36_push_walks_the_directory_once() {
    let store = tempfile::tempdir().unwrap();
    let s = Serve::start(store.path().to_str().unwrap(), &[], &[]);
    let w = Work::new();
    let snap = w.sample("snap", "8MiB");
    let dest = RegistrySource::new(&s.addr, "vm/walks", true, None).unwrap();
    let (first, seen, walks) = push_dir_lib(&w, &snap, &dest, "h1");
    assert_eq!(walks, 0, "the first push walked the directory again");
    assert!(seen.parents.lock().unwrap()[0].starts_with("none: "), "{:?}", seen.parents.lock().unwrap());

    w.ok(&["sample", snap.to_str().unwrap(), "--size", "8MiB", "--mutate", "2"]);
    // Long enough after the change that the stamp is not racy: it is recorded.
    std::thread::sleep(Duration::from_millis(50));
    let (changed, seen, walks) = push_dir_lib(&w, &snap, &dest, "h2");
    assert_eq!(walks, 0, "the push over the closest image walked the directory again");
    assert_eq!(*seen.parents.lock().unwrap(), [format!("taken {}/vm/walks:h1", s.addr)], "the closest image was searched and taken");
    assert_ne!(changed.manifest, first.manifest);
    assert!(changed.pack.is_some(), "packed");

    let (same, _, walks) = push_dir_lib(&w, &snap, &dest, "h3");
    assert_eq!(walks, 0, "the stamp's check walked the directory again");
    assert_eq!(same.reused, Some(pusher::Reused::Stamp), "{:?}", same.push);
    assert_eq!(same.manifest, changed.manifest);
}

/// Issue 39: at 200 Mbit/s `push DIR` showed a pack bar frozen below its total for the
/// whole upload, and no upload bar: the uploads made while packing had no total. The
/// observer is told the bytes to upload as packs are sealed, exactly once packing is
/// done, and every byte sent: the sum of `uploaded` is the report's `bytes_sent` and the
/// final total equals it, and packing is reported done at the directory's size.
#[test]
fn regression_issue_39_push_progress_counts_every_uploaded_byte() {
    let store = tempfile::tempdir().unwrap();
    let s = Serve::start(store.path().to_str().unwrap(), &[], &[]);
    let w = Work::new();
    let snap = w.sample("snap", "24MiB");
    let dest = RegistrySource::new(&s.addr, "vm/progress", true, None).unwrap();
    let (r, seen, _) = push_dir_lib(&w, &snap, &dest, "v1");
    let sent = r.push.bytes_sent;
    assert!(r.push.uploaded_blobs >= 6 && sent > 8 * MIB, "several packs went up: {:?}", r.push);
    assert_eq!(seen.uploaded.load(Relaxed), sent, "every uploaded byte was told, once");
    assert_eq!(seen.total.load(Relaxed), sent, "the upload total ends at the bytes uploaded");
    let (packed, total) = seen.at_packing_done.lock().unwrap().expect("packing_done was told");
    assert!(seen.scanned.load(Relaxed) > 24 * MIB, "the memory file and the state");
    assert_eq!(packed, seen.scanned.load(Relaxed), "packing ends at the directory's size");
    assert_eq!(total, sent, "the upload total is exact once packing is done");

    // Changed a little and pushed over the first image: only the change is counted.
    w.ok(&["sample", snap.to_str().unwrap(), "--size", "24MiB", "--mutate", "1"]);
    let (r, seen, _) = push_dir_lib(&w, &snap, &dest, "v2");
    assert!(r.push.bytes_sent > 0 && r.push.bytes_sent < 4 * MIB, "{:?}", r.push);
    assert_eq!(seen.uploaded.load(Relaxed), r.push.bytes_sent);
    assert_eq!(seen.total.load(Relaxed), r.push.bytes_sent);
}

/// Issue 4: re-pushing an unchanged directory re-packed all of it before finding nothing to
/// send. Now its stamp (names, sizes, times, inodes) is recorded with the manifest, a match
/// skips packing, and a write (which moves ctime) packs again and sends the change.
#[test]
fn regression_issue_4_repush_unchanged_directory_skips_packing() {
    let w = Work::new();
    let snap = w.sample("snap", "16MiB");
    // Started after the sample is written, so the first push's stamp is not "racy" (files
    // written within a clock tick of it are not trusted) and gets recorded.
    let store = tempfile::tempdir().unwrap();
    let s = Serve::start(store.path().to_str().unwrap(), &[], &[]);
    let dest = format!("{}/vm/stamp:v1", s.addr);
    let first = w.push(snap.to_str().unwrap(), &dest, &[]);
    assert_eq!(first["pack"]["skipped"], false, "{first}");
    assert!(n(&first, "bytes_sent") > 4 * MIB, "{first}");

    let again = w.push(snap.to_str().unwrap(), &dest, &[]);
    assert_eq!(again["pack"]["skipped"], true, "unchanged directory: not packed again: {again}");
    assert_eq!(again["manifest"], first["manifest"]);
    assert_eq!((n(&again, "bytes_sent"), n(&again, "uploaded_blobs")), (0, 0), "{again}");

    // Rewrite 2 blocks in place (same names, same sizes, same inodes): packed again, sent.
    w.ok(&["sample", snap.to_str().unwrap(), "--size", "16MiB", "--mutate", "2"]);
    let changed = w.push(snap.to_str().unwrap(), &dest, &[]);
    assert_eq!(changed["pack"]["skipped"], false, "a written file is packed again: {changed}");
    assert_ne!(changed["manifest"], first["manifest"], "{changed}");
    assert!(n(&changed, "bytes_sent") > 0, "{changed}");
    let out = w.path("out");
    w.ok(&["unpack", &dest, out.to_str().unwrap()]);
    same_files(&snap, &out);

    // An image already packed (oci:) has no pack step in the report.
    let lay = w.path("layout");
    w.ok(&["pack", snap.to_str().unwrap(), &format!("oci:{}:v1", lay.display())]);
    let from_layout = w.push(&format!("oci:{}:v1", lay.display()), &format!("{}/vm/lay:v1", s.addr), &[]);
    assert!(from_layout.get("pack").is_none(), "{from_layout}");
}

/// A registry announcing `OCI-Chunk-Min-Length` 4 MiB: a push asked for 1 MiB pieces
/// sends 4 MiB PATCHes (the server refuses smaller ones, shown first) and succeeds.
#[test]
fn chunked_upload_honours_min_length() {
    let store = tempfile::tempdir().unwrap();
    let s = Serve::start(store.path().to_str().unwrap(), &["--chunk-min-length", "4MiB"], &[]);
    // The server does refuse a short PATCH: the test below could fail.
    let c = reqwest::blocking::Client::new();
    let r = c.post(s.url("/v2/probe/blobs/uploads/")).send().unwrap();
    assert_eq!(r.headers()["oci-chunk-min-length"], "4194304");
    let loc = r.headers()["location"].to_str().unwrap().to_string();
    let r = c.patch(s.url(&loc)).header("content-range", "0-1048575").body(vec![1u8; MIB as usize]).send().unwrap();
    assert_eq!(r.status().as_u16(), 400);

    let w = Work::new();
    let snap = w.sample("snap", "32MiB");
    let lay = w.path("l");
    w.ok(&["pack", snap.to_str().unwrap(), &format!("oci:{}:v1", lay.display())]);
    let dest = format!("{}/vm/chunked:v1", s.addr);
    let rep = w.push(&format!("oci:{}:v1", lay.display()), &dest, &["--upload-piece", "1MiB"]);
    assert!(n(&rep, "bytes_total") > 8 * MIB, "a pack bigger than two pieces: {rep}");
    let out = w.path("out");
    w.ok(&["unpack", &dest, out.to_str().unwrap()]);
    same_files(&snap, &out);
}

/// A TCP proxy on 127.0.0.1 that forwards to `upstream`, limiting client → server bytes
/// to `rate` per second (0: unlimited) and counting them. Stopped on drop.
struct Throttle {
    addr: String,
    rate: Arc<AtomicU64>,
    forwarded: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

impl Throttle {
    fn start(upstream: &str, rate: u64) -> Throttle {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let t = Throttle { addr, rate: Arc::new(AtomicU64::new(rate)), forwarded: Arc::new(AtomicU64::new(0)), stop: Arc::new(AtomicBool::new(false)) };
        let (up, rate, fwd, stop) = (upstream.to_string(), t.rate.clone(), t.forwarded.clone(), t.stop.clone());
        std::thread::spawn(move || {
            for conn in l.incoming() {
                if stop.load(Relaxed) {
                    return;
                }
                let Ok(client) = conn else { continue };
                let Ok(server) = TcpStream::connect(&up) else { continue };
                let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                let (rate, fwd, stop2) = (rate.clone(), fwd.clone(), stop.clone());
                std::thread::spawn(move || pipe(client, server, Some((rate, fwd)), stop2));
                let stop3 = stop.clone();
                std::thread::spawn(move || pipe(s2, c2, None, stop3));
            }
        });
        t
    }
}

fn pipe(mut from: TcpStream, mut to: TcpStream, limit: Option<(Arc<AtomicU64>, Arc<AtomicU64>)>, stop: Arc<AtomicBool>) {
    let mut buf = vec![0u8; 16 << 10];
    let t0 = Instant::now();
    let mut sent = 0u64;
    loop {
        if stop.load(Relaxed) {
            break;
        }
        let k = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(k) => k,
        };
        if let Some((rate, fwd)) = &limit {
            sent += k as u64;
            let r = rate.load(Relaxed);
            if r > 0 {
                // Pace to `r` bytes/s since this connection opened.
                let due = Duration::from_secs_f64(sent as f64 / r as f64);
                if let Some(wait) = due.checked_sub(t0.elapsed()) {
                    std::thread::sleep(wait);
                }
            }
            fwd.fetch_add(k as u64, Relaxed);
        }
        if to.write_all(&buf[..k]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

impl Drop for Throttle {
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
        let _ = TcpStream::connect(&self.addr);
    }
}

/// Issue 4: a push killed with -9 in the middle of a pack upload, rerun, continues from
/// the registry's offset (kept in the cache's resume state) instead of starting over.
fn kill9_push_resumes(registry: &str, expect_resume: bool) {
    let w = Work::new();
    let snap = w.sample("snap", "32MiB");
    let lay = w.path("l");
    w.ok(&["pack", snap.to_str().unwrap(), &format!("oci:{}:v1", lay.display())]);
    let proxy = Throttle::start(registry, 4 * MIB);
    let dest = format!("{}/vm/resume:v1", proxy.addr);
    let src = format!("oci:{}:v1", lay.display());
    let mut child = w.cmd().args(["push", &src, &dest, "--upload-piece", "1MiB", "--jobs", "1"]).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while proxy.forwarded.load(Relaxed) < 6 * MIB {
        assert!(Instant::now() < deadline, "the push did not get going");
        assert!(child.try_wait().unwrap().is_none(), "the push finished before it could be killed");
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    proxy.rate.store(0, Relaxed);
    let rep = w.push(&src, &dest, &["--upload-piece", "1MiB"]);
    let (sent, resumed, total) = (n(&rep, "bytes_sent"), n(&rep, "bytes_resumed"), n(&rep, "bytes_total"));
    if expect_resume {
        assert!(resumed >= 4 * MIB, "the rerun continued the killed upload: {rep}");
        assert!(sent + resumed <= total + MIB, "resumed bytes were not sent again: {rep}");
        assert!(sent < total, "{rep}");
    } else {
        // The session is gone: the blob started over, and the result is still right.
        assert_eq!((resumed, sent), (0, total), "{rep}");
    }
    let out = w.path("out");
    w.ok(&["unpack", &format!("{registry}/vm/resume:v1"), out.to_str().unwrap()]);
    same_files(&snap, &out);
}

#[test]
fn regression_issue_4_kill9_push_resumes() {
    let store = tempfile::tempdir().unwrap();
    let s = Serve::start(store.path().to_str().unwrap(), &[], &[]);
    kill9_push_resumes(&s.addr, true);
}

/// The same against distribution 2.8. Its upload URL carries the offset in a signed
/// `_state` parameter, and it cancels a session whose size differs from that offset:
/// a push killed in the middle of a PATCH (the bytes that arrived were written) leaves a
/// session no URL we hold can continue. The rerun must notice and start the blob over.
#[test]
fn regression_issue_4_kill9_push_restarts_on_docker_registry() {
    if !have("docker-registry") {
        return;
    }
    let store = tempfile::tempdir().unwrap();
    let d = Distribution::start(store.path());
    kill9_push_resumes(&d.addr, false);
}

/// A registry's 4xx ends the push at once with the registry's own message, exit 2.
#[test]
fn registry_refusal_shows_its_message_and_exits_2() {
    let store = tempfile::tempdir().unwrap();
    let s = Serve::start(store.path().to_str().unwrap(), &["--max-manifest-bytes", "200"], &[]);
    let w = Work::new();
    let snap = w.sample("snap", "8MiB");
    let lay = w.path("l");
    w.ok(&["pack", snap.to_str().unwrap(), &format!("oci:{}:v1", lay.display())]);
    let t0 = Instant::now();
    let r = run(w.cmd().args(["push", &format!("oci:{}:v1", lay.display()), &format!("{}/vm/small:v1", s.addr)]));
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("SIZE_INVALID") && r.stderr.contains("413"), "{}", r.stderr);
    assert!(t0.elapsed() < Duration::from_secs(5), "a 4xx is not retried");
}

fn client(addr: &str, repo: &str) -> RegistrySource {
    RegistrySource::new(addr, repo, true, None).unwrap()
}

/// Push an image, hang a trace off it with push_referrer, find it with list_referrers.
fn referrers_round_trip(addr: &str, expect_api: bool) {
    let w = Work::new();
    let snap = w.sample("snap", "8MiB");
    let lay = w.path("l");
    w.ok(&["pack", snap.to_str().unwrap(), &format!("oci:{}:v1", lay.display())]);
    let rep = w.push(&format!("oci:{}:v1", lay.display()), &format!("{addr}/vm/ref:v1"), &[]);
    let subject: OciDigest = rep["manifest"].as_str().unwrap().parse().unwrap();
    let c = client(addr, "vm/ref");
    assert!(c.list_referrers(&subject, None).unwrap().is_empty());
    let ann = BTreeMap::from([("dev.snapctl.trace.pages".to_string(), "3".to_string())]);
    let t1 = c.push_referrer(&subject, "application/vnd.snapctl.trace.v1", b"pages 1 2 3", ann).unwrap();
    let t2 = c.push_referrer(&subject, "application/vnd.example.sig", b"sig", BTreeMap::new()).unwrap();
    let all = c.list_referrers(&subject, None).unwrap();
    assert_eq!(all.len(), 2, "{all:?}");
    let traces = c.list_referrers(&subject, Some("application/vnd.snapctl.trace.v1")).unwrap();
    assert_eq!(traces.len(), 1);
    assert_eq!(traces[0].digest, t1);
    assert_eq!(traces[0].annotations["dev.snapctl.trace.pages"], "3");
    assert_eq!(c.read_referrer_payload(&traces[0]).unwrap(), b"pages 1 2 3");
    assert_ne!(t1, t2);
    // Where the fallback tag lives says which path was taken.
    let tag = format!("sha256-{}", subject.hex());
    let fallback = c.resolve_tag(&tag).is_ok();
    assert_eq!(fallback, !expect_api, "fallback tag present: {fallback}");
}

#[test]
fn referrers_snapctl_serve_api() {
    let store = tempfile::tempdir().unwrap();
    let s = Serve::start(store.path().to_str().unwrap(), &[], &[]);
    referrers_round_trip(&s.addr, true);
}

#[test]
fn referrers_docker_registry_fallback_tag() {
    if !have("docker-registry") {
        return;
    }
    let store = tempfile::tempdir().unwrap();
    let d = Distribution::start(store.path());
    referrers_round_trip(&d.addr, false);
}

/// `snapctl login` against `snapctl serve --htpasswd`: without it a push fails clearly;
/// a wrong password is refused and writes nothing; the right one is stored 0600 beside
/// other entries, and then the push works. `logout` removes it again.
#[test]
fn login_then_push() {
    let store = tempfile::tempdir().unwrap();
    let pw = tempfile::tempdir().unwrap();
    htpasswd(&pw.path().join("htpasswd"), &[("alice", "s3cret")]);
    let s = Serve::start(store.path().to_str().unwrap(), &["--htpasswd", pw.path().join("htpasswd").to_str().unwrap()], &[]);
    let w = Work::new();
    let snap = w.sample("snap", "8MiB");
    let lay = w.path("l");
    w.ok(&["pack", snap.to_str().unwrap(), &format!("oci:{}:v1", lay.display())]);
    let src = format!("oci:{}:v1", lay.display());
    let dest = format!("{}/vm/auth:v1", s.addr);

    let r = run(w.cmd().args(["push", &src, &dest]));
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("snapctl login"), "says how to fix it: {}", r.stderr);

    fs::create_dir_all(w.path("docker")).unwrap();
    fs::write(w.path("docker/config.json"), r#"{"auths":{"other.example":{"auth":"eDp5"}},"credsStore":""}"#).unwrap();
    let login = |pass: &str| {
        let mut c = w.cmd();
        c.args(["login", &s.addr, "-u", "alice", "--password-stdin"]).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = c.spawn().unwrap();
        child.stdin.take().unwrap().write_all(format!("{pass}\n").as_bytes()).unwrap();
        let out = child.wait_with_output().unwrap();
        (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (code, err) = login("wrong");
    assert_eq!(code, 2, "{err}");
    assert!(!fs::read_to_string(w.path("docker/config.json")).unwrap().contains(&s.addr), "nothing stored for a refused login");
    let (code, err) = login("s3cret");
    assert_eq!(code, 0, "{err}");
    let cfg = w.path("docker/config.json");
    assert_eq!(fs::metadata(&cfg).unwrap().permissions().mode() & 0o777, 0o600);
    let v: serde_json::Value = serde_json::from_slice(&fs::read(&cfg).unwrap()).unwrap();
    assert_eq!(v["auths"]["other.example"]["auth"], "eDp5", "other entries kept");
    assert!(v["auths"][&s.addr]["auth"].is_string());

    let r = run(w.cmd().args(["push", &src, &dest]));
    assert_eq!(r.code, 0, "{r:?}");
    w.ok(&["logout", &s.addr]);
    let v: serde_json::Value = serde_json::from_slice(&fs::read(&cfg).unwrap()).unwrap();
    assert!(v["auths"].get(&s.addr).is_none());
}

/// Issue 4: retryable failures during a push — 429s on HEAD, a burst of 503s on PATCH, a
/// PATCH whose response is reset after the registry took it, a final PUT reset after it
/// committed — and the push still completes, continuing from the registry's offset
/// (asked with GET on the session) rather than starting blobs over.
#[test]
fn regression_issue_4_push_survives_transient_failures() {
    use snapctl_tests::fault_proxy::{Fault, FaultProxy, Match, Rule};
    let store = tempfile::tempdir().unwrap();
    let s = Serve::start(store.path().to_str().unwrap(), &[], &[]);
    let proxy = FaultProxy::start(s.addr.as_str()).unwrap();
    proxy.add(Rule::new(Fault::Status { code: 429 }).on(Match::new("HEAD", "/blobs/")).times(2));
    proxy.add(Rule::new(Fault::Status { code: 503 }).on(Match::new("PATCH", "/blobs/uploads/")).nth(2).times(3));
    proxy.add(Rule::new(Fault::Reset { after: 0 }).on(Match::new("PATCH", "/blobs/uploads/")).nth(6));
    proxy.add(Rule::new(Fault::Reset { after: 0 }).on(Match::new("PUT", "/blobs/uploads/")));
    let w = Work::new();
    let snap = w.sample("snap", "32MiB");
    let lay = w.path("l");
    w.ok(&["pack", snap.to_str().unwrap(), &format!("oci:{}:v1", lay.display())]);
    let rep = w.push(&format!("oci:{}:v1", lay.display()), &format!("{}/vm/flaky:v1", proxy.addr), &["--upload-piece", "1MiB", "--jobs", "2"]);
    assert!(proxy.faults() >= 7, "all planned faults fired: {}", proxy.faults());
    let (sent, total) = (n(&rep, "bytes_sent"), n(&rep, "bytes_total"));
    // The 503s were never forwarded; the reset PATCH had been taken: nothing is resent
    // beyond the pieces the faults hit.
    assert!(sent <= total + 4 * MIB, "continued from the registry's offset: {rep}");
    let out = w.path("out");
    w.ok(&["unpack", &format!("{}/vm/flaky:v1", s.addr), out.to_str().unwrap()]);
    same_files(&snap, &out);
}

/// `copy` registry → registry (snapctl serve → docker-registry) and back out to a layout
/// keeps the manifest digest; a source registry that flips a byte of every blob it serves
/// makes the copy exit 1 with nothing committed at the destination.
#[test]
fn copy_between_registries_keeps_digests_and_refuses_a_lying_source() {
    use snapctl_tests::fault_proxy::{Fault, FaultProxy, Match, Rule};
    if !have("docker-registry") {
        return;
    }
    let store = tempfile::tempdir().unwrap();
    let s = Serve::start(store.path().to_str().unwrap(), &[], &[]);
    let dstore = tempfile::tempdir().unwrap();
    let d = Distribution::start(dstore.path());
    let w = Work::new();
    let snap = w.sample("snap", "8MiB");
    let lay = w.path("l");
    let v1 = w.ok(&["pack", snap.to_str().unwrap(), &format!("oci:{}:v1", lay.display())]).stdout.trim().to_string();
    w.push(&format!("oci:{}:v1", lay.display()), &format!("{}/vm/src:v1", s.addr), &[]);
    let r = w.ok(&["copy", &format!("{}/vm/src:v1", s.addr), &format!("{}/mirror/vm:v1", d.addr)]);
    assert_eq!(r.stdout.trim(), v1);
    let back = w.path("back");
    let r = w.ok(&["copy", &format!("{}/mirror/vm:v1", d.addr), &format!("oci:{}:v1", back.display())]);
    assert_eq!(r.stdout.trim(), v1);
    w.ok(&["verify", &format!("oci:{}:v1", back.display())]);

    let proxy = FaultProxy::start(s.addr.as_str()).unwrap();
    proxy.add(Rule::new(Fault::FlipByte { at: 100 }).on(Match::blob_gets()).times(u64::MAX));
    // A fresh cache: with the old one the blobs would (rightly) be mounted from
    // mirror/vm, and nothing read from the liar.
    let w2 = Work::new();
    let r = run(w2.cmd().args(["copy", &format!("{}/vm/src:v1", proxy.addr), &format!("{}/mirror/lied:v1", d.addr)]));
    assert_eq!(r.code, 1, "a digest mismatch is a verification failure: {r:?}");
    assert!(r.stderr.contains("hash to"), "{}", r.stderr);
    let c = client(&d.addr, "mirror/lied");
    assert!(c.resolve_tag("v1").is_err(), "no tag at the destination");
    let m: imgfmt::Manifest = imgfmt::Manifest::decode(&fs::read(lay.join("blobs/sha256").join(v1.trim_start_matches("sha256:"))).unwrap()).unwrap();
    for l in &m.layers {
        assert!(!c.blob_exists(&l.digest).unwrap(), "{} was not committed", l.digest);
    }
}
