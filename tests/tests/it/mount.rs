//! `snapctl mount` (spec/mount.md): an image's files through a read-only FUSE host mount,
//! read lazily and verified; many images on one host mount; the clone layout; the life
//! cycle and bad input.
//!
//! Every test needs root and /dev/fuse (it mounts); without them it prints a skip note,
//! and with SNAPCTL_REQUIRE_PEERS=1 fails. Each test has a host mount of its own
//! (`SNAPCTL_MOUNT_HOST` in its temporary directory) and unmounts everything before that
//! directory goes ([`Mounted`]'s drop). The host's FUSE request timeout
//! (`fs.fuse.default_request_timeout`, Linux >= 6.14) is set to 60 s when it is unset, so a
//! daemon that hangs aborts its connection instead of holding a test (and CI) forever.

use std::fs;
use std::io::Read as _;
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use snapctl_tests::{require_peers, run, snapctl, Run, SplitMix64};

const MIB: u64 = 1 << 20;

/// Whether this host can run the tests (root, /dev/fuse); sets the request timeout.
fn mount_usable() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let ok = root && Path::new("/dev/fuse").exists();
    assert!(ok || !require_peers(), "snapctl mount tests need root and /dev/fuse (SNAPCTL_REQUIRE_PEERS=1)");
    if !ok {
        eprintln!("SKIP: snapctl mount needs root and /dev/fuse");
        return false;
    }
    let knob = Path::new("/proc/sys/fs/fuse/default_request_timeout");
    if fs::read_to_string(knob).is_ok_and(|v| v.trim() == "0") {
        let _ = fs::write(knob, "60\n");
    }
    true
}

/// The mount on top at `dir`, from /proc/self/mountinfo: its file system type.
fn mounted_at(dir: &Path) -> Option<String> {
    let text = fs::read_to_string("/proc/self/mountinfo").unwrap();
    text.lines().rev().find_map(|l| {
        let (left, right) = l.split_once(" - ")?;
        let mp = left.split(' ').nth(4)?.replace("\\040", " ");
        (Path::new(&mp) == dir).then(|| right.split(' ').next().unwrap_or_default().to_string())
    })
}

/// Mounts whose mount point lies under `dir`.
fn mounts_under(dir: &Path) -> Vec<String> {
    let text = fs::read_to_string("/proc/self/mountinfo").unwrap();
    text.lines().filter_map(|l| l.split(' ').nth(4).map(str::to_string)).filter(|mp| Path::new(mp).starts_with(dir)).collect()
}

/// One test's place: its temporary directory, host mount point and chunk cache.
struct Place {
    tmp: tempfile::TempDir,
}

impl Place {
    fn new() -> Place {
        Place { tmp: tempfile::tempdir().unwrap() }
    }
    fn path(&self) -> &Path {
        self.tmp.path()
    }
    fn host(&self) -> PathBuf {
        self.path().join("host")
    }
    fn cache(&self) -> PathBuf {
        self.path().join("cache")
    }
    /// Wait (10 s at most) until the host mount's daemon counts no open file of the
    /// images it shows: the kernel tells it of a closed open (FUSE_RELEASE) after `close`
    /// or `munmap` has returned, so a next open may otherwise still find it alive.
    fn wait_all_closed(&self) {
        use std::io::{BufRead, Write};
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let mut s = std::os::unix::net::UnixStream::connect(self.path().join("host.sock")).unwrap();
            s.write_all(b"{\"op\":\"status\"}\n").unwrap();
            let mut line = String::new();
            std::io::BufReader::new(s).read_line(&mut line).unwrap();
            let v: serde_json::Value = serde_json::from_str(&line).unwrap();
            let open: u64 = v["binds"].as_array().expect("binds").iter().map(|b| b["open_files"].as_u64().unwrap_or(0)).sum();
            if open == 0 {
                return;
            }
            assert!(Instant::now() < deadline, "the daemon still counts {open} open files: {line}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    /// An empty directory to mount into.
    fn dir(&self, name: &str) -> PathBuf {
        let d = self.path().join(name);
        fs::create_dir_all(&d).unwrap();
        d
    }
    /// `snapctl` with this place's host mount.
    fn snapctl(&self) -> Command {
        let mut c = snapctl();
        c.env("SNAPCTL_MOUNT_HOST", self.host());
        c
    }
}

impl Drop for Place {
    /// Nothing stays mounted under the directory about to go: every DIR and the host mount
    /// detached (the daemons are children of the tests' `Mounted`, killed by their drops).
    fn drop(&mut self) {
        for _ in 0..3 {
            let mut left = mounts_under(self.path());
            if left.is_empty() {
                return;
            }
            left.reverse();
            for mp in left {
                let _ = Command::new("umount").arg("-l").arg(&mp).stdout(Stdio::null()).stderr(Stdio::null()).status();
            }
        }
    }
}

/// A `snapctl mount` in the foreground: its log, its exit and its `--json` report.
struct Mounted {
    child: Child,
    dir: PathBuf,
    log: PathBuf,
    out: PathBuf,
}

impl Mounted {
    /// Start `snapctl mount IMAGE DIR --json EXTRA...` and wait until DIR shows it.
    fn start(place: &Place, image: &str, dir: &Path, extra: &[&str]) -> Mounted {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let (log, out) = (place.path().join(format!("{name}.log")), place.path().join(format!("{name}.json")));
        let mut cmd = place.snapctl();
        cmd.args(["mount", image]).arg(dir).arg("--json");
        if !extra.contains(&"--no-cache") {
            cmd.arg("--cache").arg(place.cache());
        }
        let child = cmd.args(extra).stdout(fs::File::create(&out).unwrap()).stderr(fs::File::create(&log).unwrap()).spawn().expect("spawn snapctl mount");
        let mut m = Mounted { child, dir: dir.to_path_buf(), log, out };
        let deadline = Instant::now() + Duration::from_secs(30);
        while mounted_at(dir).is_none() || !m.log_text().contains("shown in") {
            if let Ok(Some(st)) = m.child.try_wait() {
                panic!("snapctl mount exited with {st} before DIR showed the image: {}", m.log_text());
            }
            assert!(Instant::now() < deadline, "DIR not mounted within 30 s: {}", m.log_text());
            std::thread::sleep(Duration::from_millis(20));
        }
        m
    }

    fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Wait for the process to end (after DIR was unmounted): exit code and report.
    fn finish(&mut self, within: Duration) -> (i32, Value) {
        let deadline = Instant::now() + within;
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                let out = fs::read_to_string(&self.out).unwrap_or_default();
                return (st.code().unwrap_or(-1), serde_json::from_str(out.trim()).unwrap_or(Value::Null));
            }
            assert!(Instant::now() < deadline, "snapctl mount still running after {within:?}: {}", self.log_text());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `snapctl umount DIR --json`, then the mount's own end: (umount's run, exit, report).
    fn umount(&mut self, place: &Place) -> (Run, i32, Value) {
        let r = run(place.snapctl().arg("umount").arg(&self.dir).arg("--json"));
        let (code, report) = self.finish(Duration::from_secs(30));
        (r, code, report)
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        if mounted_at(&self.dir).is_some() {
            let _ = snapctl().args(["umount", "--lazy"]).arg(&self.dir).stdout(Stdio::null()).stderr(Stdio::null()).status();
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("snapctl mount log:\n{}", self.log_text());
        }
    }
}

fn n(v: &Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or_else(|| panic!("{key} is not a number in {v}"))
}

fn xorshift(seed: u64, buf: &mut [u8]) {
    let mut x = SplitMix64(seed);
    for c in buf.chunks_mut(8) {
        c.copy_from_slice(&x.next_u64().to_le_bytes()[..c.len()]);
    }
}

/// The four data patterns of the suite (zeros, random, text, sparse: holes with a few
/// random pages), at sizes off chunk boundaries, with a file in a subdirectory and modes.
fn write_patterns(src: &Path) {
    let file = |name: &str, size: u64, mode: u32, fill: &dyn Fn(&fs::File)| {
        let p = src.join(name);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        let f = fs::File::create(&p).unwrap();
        f.set_len(size).unwrap();
        fill(&f);
        fs::set_permissions(&p, fs::Permissions::from_mode(mode)).unwrap();
    };
    file("zero.img", 3 * MIB + 5, 0o644, &|_| {});
    file("random.img", 3 * MIB + 4097, 0o600, &|f| {
        let mut b = vec![0u8; (3 * MIB + 4097) as usize];
        xorshift(7, &mut b);
        f.write_all_at(&b, 0).unwrap();
    });
    file("text.img", 2 * MIB + 77, 0o640, &|f| {
        let words = b"restore the sandbox page by page ";
        let b: Vec<u8> = (0..2 * MIB + 77).map(|i| words[i as usize % words.len()]).collect();
        f.write_all_at(&b, 0).unwrap();
    });
    file("sparse.img", 4 * MIB, 0o755, &|f| {
        let mut page = vec![0u8; 4096];
        for (i, off) in [0u64, 300 * 1024, MIB + 12345, 3 * MIB + 65536].into_iter().enumerate() {
            xorshift(100 + i as u64, &mut page);
            f.write_all_at(&page, off).unwrap();
        }
    });
    file("sub/dir/nested.img", 10_000, 0o644, &|f| f.write_all_at(b"nested file", 5000).unwrap());
}

/// A `snapctl sample` of `size` with `seed` (and `sample_args`) in `place`'s `snap`, packed
/// as `v1` with `pack_args`: the snapshot's directory and the image's reference.
fn sampled(place: &Place, size: &str, seed: u32, sample_args: &[&str], pack_args: &[&str]) -> (PathBuf, String) {
    let snap = place.path().join("snap");
    let r = run(snapctl().arg("sample").arg(&snap).args(["--size", size, "--seed", &seed.to_string()]).args(sample_args));
    assert_eq!(r.code, 0, "sample: {r:?}");
    let image = pack(place, &snap, "v1", pack_args);
    (snap, image)
}

/// Pack `src` into a layout under `place` as `tag`.
fn pack(place: &Place, src: &Path, tag: &str, extra: &[&str]) -> String {
    let reference = format!("oci:{}:{tag}", place.path().join("layout").display());
    let r = run(snapctl().arg("pack").arg(src).arg(&reference).args(extra));
    assert_eq!(r.code, 0, "pack: {r:?}");
    reference
}

/// The bytes of `path` through a private read-only mapping.
fn mapped(path: &Path) -> Vec<u8> {
    let f = fs::File::open(path).unwrap();
    let len = f.metadata().unwrap().len() as usize;
    if len == 0 {
        return Vec::new();
    }
    use std::os::fd::AsRawFd;
    // SAFETY: a fresh private read-only mapping of a file we opened, unmapped below.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_PRIVATE, f.as_raw_fd(), 0) };
    assert_ne!(p, libc::MAP_FAILED, "mmap {}", path.display());
    // SAFETY: `len` bytes are mapped at `p`.
    let v = unsafe { std::slice::from_raw_parts(p as *const u8, len) }.to_vec();
    // SAFETY: unmapping what we mapped.
    unsafe { libc::munmap(p, len) };
    v
}

/// The file at `path` holds `want`: read whole, mapped, and read at odd places (across a
/// 256 KiB chunk boundary, one byte, the tail, past the end).
fn reads_right(path: &Path, want: &[u8], name: &str) {
    assert!(fs::read(path).unwrap() == want, "{name}: read differs");
    assert!(mapped(path) == want, "{name}: mmap differs");
    let f = fs::File::open(path).unwrap();
    for (off, len) in [(256 * 1024 - 3, 10usize), (1, 1), (want.len().saturating_sub(7) as u64, 100), (want.len() as u64 + 10, 10)] {
        let mut buf = vec![0u8; len];
        let got = f.read_at(&mut buf, off).unwrap();
        let end = (off as usize + len).min(want.len());
        let expect = if (off as usize) < want.len() { &want[off as usize..end] } else { &[][..] };
        assert_eq!(&buf[..got], expect, "{name}: {len} bytes at {off}");
    }
}

const PATTERN_FILES: [&str; 5] = ["zero.img", "random.img", "text.img", "sparse.img", "sub/dir/nested.img"];

#[test]
fn every_byte_of_every_data_pattern_reads_right_by_read_and_by_mmap() {
    if !mount_usable() {
        return;
    }
    let place = Place::new();
    let src = place.path().join("src");
    write_patterns(&src);
    let image = pack(&place, &src, "v1", &["--chunk-size", "256KiB"]);
    let dir = place.dir("d");
    let mut m = Mounted::start(&place, &image, &dir, &["--prefetch", "none"]);
    for name in PATTERN_FILES {
        let (want, path) = (fs::read(src.join(name)).unwrap(), dir.join(name));
        let meta = fs::metadata(&path).unwrap();
        assert_eq!(meta.len(), want.len() as u64, "{name}: size");
        assert_eq!(meta.mode() & 0o7777, fs::metadata(src.join(name)).unwrap().mode() & 0o775, "{name}: mode");
        reads_right(&path, &want, name);
    }
    assert!(fs::OpenOptions::new().write(true).open(dir.join("text.img")).is_err(), "read-only");
    let (r, code, report) = m.umount(&place);
    assert_eq!(r.code, 0, "umount: {r:?}");
    assert_eq!(code, 0, "{}", m.log_text());
    assert_eq!(n(&report, "verify_failures"), 0, "{report}");
    assert_eq!(n(&report, "read_failures"), 0, "{report}");
    assert!(mounts_under(place.path()).is_empty(), "nothing left mounted");
}

/// `--regions`-free check that a report's fetch count is each stored chunk once.
fn stored_chunks(layout: &Path, tag: &str, file: &str) -> u64 {
    use imgfmt::BlobSource;
    let l = imgfmt::OciLayout::open(layout).unwrap();
    let image = imgfmt::Image::open(&l, &l.resolve_tag(tag).unwrap()).unwrap();
    let f = image.file(file).unwrap().1;
    let mut digests: Vec<_> = f.chunks.iter().filter(|c| c.at != imgfmt::StoredAt::Zero).map(|c| c.digest).collect();
    digests.sort_unstable_by_key(|d| d.to_hex());
    digests.dedup();
    digests.len() as u64
}

#[test]
fn concurrent_readers_see_the_same_bytes_and_each_chunk_is_fetched_once() {
    if !mount_usable() {
        return;
    }
    let place = Place::new();
    let (snap, image) = sampled(&place, "24MiB", 11, &[], &[]);
    let dir = place.dir("d");
    let mut m = Mounted::start(&place, &image, &dir, &["--prefetch", "none", "--no-cache"]);
    let want = fs::read(snap.join("vm.mem")).unwrap();
    std::thread::scope(|s| {
        for t in 0..8u64 {
            let (want, path) = (&want, dir.join("vm.mem"));
            s.spawn(move || {
                let f = fs::File::open(&path).unwrap();
                let mut rng = SplitMix64(t);
                for _ in 0..200 {
                    let off = rng.next_u64() % want.len() as u64;
                    let len = (rng.next_u64() % (300 * 1024)) as usize + 1;
                    let mut buf = vec![0u8; len];
                    let got = f.read_at(&mut buf, off).unwrap();
                    assert_eq!(&buf[..got], &want[off as usize..(off as usize + len).min(want.len())], "thread {t}: {len} at {off}");
                }
            });
        }
    });
    let (_, code, report) = m.umount(&place);
    assert_eq!(code, 0);
    assert!(n(&report, "fetched_chunks") <= stored_chunks(&place.path().join("layout"), "v1", "vm.mem"), "each chunk fetched once at most: {report}");
}

/// A tampered stored chunk: the reads touching it fail with EIO, the rest of the file
/// reads right, and the daemon's log names the file and the chunk.
#[test]
fn a_tampered_chunk_fails_its_range_with_eio_the_rest_reads_right_and_the_log_names_it() {
    if !mount_usable() {
        return;
    }
    let place = Place::new();
    let (snap, image) = sampled(&place, "8MiB", 4, &["--zero-fraction", "0"], &["--compress", "none"]);
    let bad = snapctl_tests::tamper_first_stored_chunk(&place.path().join("layout"), "v1", "vm.mem");
    let dir = place.dir("d");
    let mut m = Mounted::start(&place, &image, &dir, &["--prefetch", "none", "--no-cache"]);
    let want = fs::read(snap.join("vm.mem")).unwrap();
    let f = fs::File::open(dir.join("vm.mem")).unwrap();
    let mut buf = vec![0u8; 4096];
    // The tampered byte is at 100 in the chunk: a read over it fails (a read of another
    // slice of the chunk may be served, checked against its own slice digest).
    let e = f.read_at(&mut buf, bad * MIB).expect_err("a read over the tampered byte fails");
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    for c in (0..8).filter(|&c| c != bad) {
        let mut chunk = vec![0u8; MIB as usize];
        f.read_exact_at(&mut chunk, c * MIB).unwrap_or_else(|e| panic!("chunk {c}: {e}"));
        assert!(chunk == want[(c * MIB) as usize..((c + 1) * MIB) as usize], "chunk {c} differs");
    }
    drop(f);
    let log = m.log_text();
    assert!(log.contains(&format!("vm.mem: chunk {bad} at offset {}", bad * MIB)), "the log names the chunk: {log}");
    let (_, code, report) = m.umount(&place);
    assert_eq!(code, 1, "a verification failure while mounted exits 1: {report}");
    assert!(n(&report, "read_failures") >= 1 && n(&report, "verify_failures") >= 2, "{report}");
}

/// N test VMMs restore from one mounted vm.mem as a File memory backend would (map it
/// MAP_PRIVATE): each sees the snapshot's bytes and only its own writes, and the daemon
/// fetched and verified each chunk once whatever N.
#[test]
fn n_vmms_mapping_one_mounted_memory_file_private_see_its_bytes_and_only_their_own_writes() {
    if !mount_usable() {
        return;
    }
    let place = Place::new();
    let (snap, image) = sampled(&place, "32MiB", 21, &[], &[]);
    let dir = place.dir("d");
    let mut m = Mounted::start(&place, &image, &dir, &["--prefetch", "none"]);
    let vmms: Vec<Child> = (0..4)
        .map(|i| {
            Command::new(env!("CARGO_BIN_EXE_fake_vmm"))
                .arg("--map-file")
                .arg(dir.join("vm.mem"))
                .arg("--mem-file")
                .arg(snap.join("vm.mem"))
                .args(["--write-pages", "150", "--hold-ms", "400", "--json", "--seed", &i.to_string()])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for v in vmms {
        let o = v.wait_with_output().unwrap();
        let j: Value = serde_json::from_slice(&o.stdout).unwrap_or(Value::Null);
        assert_eq!(o.status.code(), Some(0), "fake_vmm: {j} {}", String::from_utf8_lossy(&o.stderr));
        assert_eq!(n(&j, "mismatches"), 0, "{j}");
        assert_eq!(n(&j, "written_pages"), 150, "{j}");
    }
    let (_, code, report) = m.umount(&place);
    assert_eq!(code, 0);
    let chunks = stored_chunks(&place.path().join("layout"), "v1", "vm.mem");
    assert_eq!(n(&report, "fetched_chunks"), chunks, "each stored chunk fetched and verified once for 4 VMMs: {report}");
}

/// A clone: the base's snapshot with some 4 KiB pages rewritten.
fn clone_of(base: &Path, dst: &Path, seed: u64, pages: &[u64]) {
    fs::create_dir_all(dst).unwrap();
    for f in ["vm.mem", "vm.state"] {
        fs::copy(base.join(f), dst.join(f)).unwrap();
    }
    let f = fs::OpenOptions::new().write(true).open(dst.join("vm.mem")).unwrap();
    let mut page = vec![0u8; 4096];
    for &p in pages {
        xorshift(seed ^ p, &mut page);
        f.write_all_at(&page, p * 4096).unwrap();
    }
}

/// Two clones of one base through the clone layout: both show the base's memory file as
/// one inode, their own pages and map; a runtime mapping the base MAP_PRIVATE with the
/// clone's pages over it sees every page of the clone.
#[test]
fn two_clones_of_one_base_restore_every_page_through_the_clone_layout() {
    if !mount_usable() {
        return;
    }
    let place = Place::new();
    let base = place.path().join("base");
    assert_eq!(run(snapctl().arg("sample").arg(&base).args(["--size", "16MiB", "--seed", "31"])).code, 0);
    let base_ref = pack(&place, &base, "base", &[]);
    let mut dirs = Vec::new();
    let mut mounts = Vec::new();
    for (i, pages) in [vec![1u64, 2, 700, 2048, 4095], vec![3u64, 1024, 1025, 3000]].into_iter().enumerate() {
        let snap = place.path().join(format!("clone{i}"));
        clone_of(&base, &snap, i as u64 + 1, &pages);
        let r = pack(&place, &snap, &format!("c{i}"), &["--base", &base_ref]);
        let dir = place.dir(&format!("d{i}"));
        mounts.push(Mounted::start(&place, &r, &dir, &["--prefetch", "none"]));
        let map = fs::read(dir.join(".clone/vm.mem.pagemap")).unwrap();
        let set: Vec<u64> = (0..map.len() as u64 * 8).filter(|p| map[(p / 8) as usize] & (1 << (p % 8)) != 0).collect();
        assert_eq!(set, pages, "the map names exactly the clone's own pages");
        let o = Command::new(env!("CARGO_BIN_EXE_fake_vmm"))
            .arg("--map-file")
            .arg(dir.join(".clone/vm.mem.base"))
            .arg("--pages")
            .arg(dir.join(".clone/vm.mem.pages"))
            .arg("--page-map")
            .arg(dir.join(".clone/vm.mem.pagemap"))
            .arg("--mem-file")
            .arg(snap.join("vm.mem"))
            .args(["--write-pages", "10", "--json"])
            .output()
            .unwrap();
        let j: Value = serde_json::from_slice(&o.stdout).unwrap_or(Value::Null);
        assert_eq!(o.status.code(), Some(0), "fake_vmm: {j} {}", String::from_utf8_lossy(&o.stderr));
        assert_eq!(n(&j, "overlaid_pages"), pages.len() as u64, "{j}");
        dirs.push(dir);
    }
    let ino = |d: &Path| fs::metadata(d.join(".clone/vm.mem.base")).unwrap().ino();
    assert_eq!(ino(&dirs[0]), ino(&dirs[1]), "one inode for the base's memory file, whichever clone shows it");
    assert_ne!(ino(&dirs[0]), fs::metadata(dirs[0].join("vm.mem")).unwrap().ino());
    for m in mounts.iter_mut().rev() {
        let (r, _, _) = m.umount(&place);
        assert_eq!(r.code, 0, "{r:?}");
    }
}

#[test]
fn unmount_refuses_while_a_file_is_open_then_waits_or_detaches() {
    if !mount_usable() {
        return;
    }
    let place = Place::new();
    let (snap, image) = sampled(&place, "4MiB", 5, &[], &[]);
    let dir = place.dir("d");
    let mut m = Mounted::start(&place, &image, &dir, &[]);
    let mut f = fs::File::open(dir.join("vm.state")).unwrap();
    let r = run(place.snapctl().arg("umount").arg(&dir));
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("open or mapped") && r.stderr.trim().lines().count() == 1, "one line naming why: {}", r.stderr);
    assert!(mounted_at(&dir).is_some(), "still mounted");
    let mut waiting = place.snapctl().arg("umount").arg("--wait").arg(&dir).stderr(Stdio::piped()).spawn().unwrap();
    std::thread::sleep(Duration::from_millis(500));
    assert!(waiting.try_wait().unwrap().is_none(), "--wait waits while the file is open");
    let mut s = Vec::new();
    f.read_to_end(&mut s).unwrap();
    assert_eq!(s, fs::read(snap.join("vm.state")).unwrap());
    drop(f);
    let deadline = Instant::now() + Duration::from_secs(20);
    let st = loop {
        if let Some(st) = waiting.try_wait().unwrap() {
            break st;
        }
        assert!(Instant::now() < deadline, "umount --wait did not end after the file was closed");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(st.success());
    assert_eq!(m.finish(Duration::from_secs(20)).0, 0);
    assert!(mounts_under(place.path()).is_empty());

    // --lazy: DIR goes at once; the open file keeps reading until closed.
    let mut m = Mounted::start(&place, &image, &dir, &[]);
    let f = fs::File::open(dir.join("vm.mem")).unwrap();
    let r = run(place.snapctl().args(["umount", "--lazy"]).arg(&dir));
    assert_eq!(r.code, 0, "{r:?}");
    assert!(mounted_at(&dir).is_none(), "DIR detached");
    let mut b = vec![0u8; 4096];
    f.read_exact_at(&mut b, 0).unwrap();
    assert_eq!(b, fs::read(snap.join("vm.mem")).unwrap()[..4096]);
    drop(f);
    assert_eq!(m.finish(Duration::from_secs(20)).0, 0, "the daemon ends once the file is closed");
}

#[test]
fn a_killed_daemon_leaves_enotconn_and_a_new_mount_resumes_from_the_cache() {
    if !mount_usable() {
        return;
    }
    let place = Place::new();
    let (snap, image) = sampled(&place, "8MiB", 6, &[], &[]);
    let dir = place.dir("d");
    let mut m = Mounted::start(&place, &image, &dir, &["--prefetch", "all"]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !m.log_text().contains("fill done") {
        assert!(Instant::now() < deadline, "no fill: {}", m.log_text());
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    m.child.kill().unwrap();
    m.child.wait().unwrap();
    let e = fs::read(dir.join("vm.mem")).expect_err("a mount whose daemon was killed");
    assert_eq!(e.raw_os_error(), Some(libc::ENOTCONN), "{e}");
    let r = run(place.snapctl().arg("umount").arg(&dir));
    assert_eq!(r.code, 0, "umount of a dead mount: {r:?}");
    assert!(mounted_at(&dir).is_none());
    let mut m = Mounted::start(&place, &image, &dir, &["--prefetch", "none"]);
    assert!(fs::read(dir.join("vm.mem")).unwrap() == fs::read(snap.join("vm.mem")).unwrap());
    let (_, code, report) = m.umount(&place);
    assert_eq!(code, 0);
    assert_eq!(n(&report, "fetched_chunks"), 0, "everything from the cache the first daemon filled: {report}");
    assert!(n(&report, "cache_hits") > 0, "{report}");
}

/// Each bad input: one line naming what to do, exit 2 (1 for a policy refusal), nothing
/// left mounted.
#[test]
fn each_bad_input_is_one_line_and_exit_2_and_leaves_nothing_mounted() {
    if !mount_usable() {
        return;
    }
    let place = Place::new();
    let (_, image) = sampled(&place, "2MiB", 8, &[], &[]);
    let check = |r: &Run, code: i32, says: &str| {
        assert_eq!(r.code, code, "{r:?}");
        let lines: Vec<&str> = r.stderr.trim().lines().collect();
        assert!(lines.len() == 1 && lines[0].contains(says), "one line saying {says:?}: {}", r.stderr);
        assert!(mounts_under(place.path()).is_empty(), "nothing left mounted: {:?}", mounts_under(place.path()));
    };
    let mount = |dir: &Path, extra: &[&str]| run(place.snapctl().args(["mount", &image]).arg(dir).arg("--cache").arg(place.cache()).args(extra));
    check(&mount(&place.path().join("missing"), &[]), 2, "no such directory: create an empty directory");
    let full = place.dir("full");
    fs::write(full.join("x"), b"x").unwrap();
    check(&mount(&full, &[]), 2, "not empty");
    let mp = place.dir("mp");
    assert!(Command::new("mount").args(["-t", "tmpfs", "tmpfs"]).arg(&mp).status().unwrap().success());
    let r = mount(&mp, &[]);
    let _ = Command::new("umount").arg(&mp).status();
    check(&r, 2, "already a mount point (tmpfs)");
    let policy = place.path().join("policy.json");
    fs::write(&policy, r#"{"default":[{"type":"reject"}]}"#).unwrap();
    check(&mount(&place.dir("p"), &["--policy", policy.to_str().unwrap()]), 1, "");
    // Not permitted: a user without CAP_SYS_ADMIN.
    fs::set_permissions(place.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let nobody_dir = place.dir("nobody");
    fs::set_permissions(&nobody_dir, fs::Permissions::from_mode(0o777)).unwrap();
    let r = run(Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all", "--"])
        .arg(snapctl_tests::snapctl_bin())
        .args(["mount", &image])
        .arg(&nobody_dir)
        .env("SNAPCTL_MOUNT_HOST", place.host()));
    check(&r, 2, "mounting needs root (CAP_SYS_ADMIN)");
    // No /dev/fuse: a mount namespace whose /dev is an empty tmpfs.
    let script = format!("mount -t tmpfs none /dev && exec {} mount {image} {}", snapctl_tests::snapctl_bin().display(), place.dir("nofuse").display());
    let r = run(Command::new("unshare").args(["--mount", "--propagation", "private", "sh", "-c", &script]).env("SNAPCTL_MOUNT_HOST", place.host()));
    check(&r, 2, "no /dev/fuse on this host");
}

/// gVisor: trixie's runsc (2024, the split checkpoint format) restores a checkpoint whose
/// directory is a snapctl mount, and the restored program continues its count with its
/// heap intact (as the pull round trip in runsc.rs checks).
#[test]
fn runsc_2024_restores_from_a_mounted_checkpoint_and_the_counter_continues() {
    use crate::runsc::{bundle, skip, Runsc};
    use snapctl_tests::counter::{self, ticks, wait_for_count};
    if !mount_usable() || !snapctl_tests::have("gcc") {
        return;
    }
    let bin = std::env::var_os("SNAPCTL_RUNSC_SPLIT").map(PathBuf::from).unwrap_or_else(|| "/opt/snapctl-runsc/runsc".into());
    if !bin.is_file() {
        return skip(&format!("no runsc 2024 at {} (run `bash scripts/install-trixie.sh runsc`, or set SNAPCTL_RUNSC_SPLIT)", bin.display()));
    }
    let place = Place::new();
    let t = place.path();
    let counter = match counter::build(t) {
        Ok(c) => c,
        Err(e) => return skip(&e),
    };
    let (bundle_a, out_a) = (t.join("a/bundle"), t.join("a/out"));
    bundle(&bin, &bundle_a, &counter, &out_a);
    let mut host_a = Runsc { bin: bin.clone(), root: t.join("a/runsc"), ids: vec![] };
    let id_a = format!("snapctl-mount-a-{}", std::process::id());
    let r = host_a.start(&id_a, &["run", "-detach", "--bundle", bundle_a.to_str().unwrap(), &id_a]);
    if r.code != 0 {
        return skip(&format!("runsc run failed (ptrace platform unavailable?): {}", r.stderr.trim()));
    }
    wait_for_count(&out_a.join("progress"), 5, "before checkpoint");
    let ckpt = t.join("a/ckpt");
    fs::create_dir_all(&ckpt).unwrap();
    let r = run(host_a.cmd().args(["checkpoint", "--compression=none", "--exclude-committed-zero-pages", "--image-path"]).arg(&ckpt).arg(&id_a));
    assert_eq!(r.code, 0, "runsc checkpoint: {}", r.stderr);
    let at_checkpoint = ticks(&out_a.join("progress")).last().cloned().expect("ticks before checkpoint");
    let r = run(host_a.cmd().args(["delete", "-force", &id_a]));
    assert_eq!(r.code, 0, "runsc delete: {}", r.stderr);
    let image = pack(&place, &ckpt, "v1", &["--kind", "gvisor"]);
    fs::remove_dir_all(&ckpt).unwrap();

    let dir = place.dir("restore");
    let mut m = Mounted::start(&place, &image, &dir, &[]);
    let (bundle_b, out_b) = (t.join("b/bundle"), t.join("b/out"));
    bundle(&bin, &bundle_b, &counter, &out_b);
    let mut host_b = Runsc { bin, root: t.join("b/runsc"), ids: vec![] };
    let id_b = format!("snapctl-mount-b-{}", std::process::id());
    let r = host_b.start(&id_b, &["restore", "-detach", "--image-path", dir.to_str().unwrap(), "--bundle", bundle_b.to_str().unwrap(), &id_b]);
    assert_eq!(r.code, 0, "runsc restore from the mount: {}\n{}", r.stderr, m.log_text());
    counter::assert_continued(&out_b.join("progress"), 0, &at_checkpoint, "restored from the mount");
    drop(host_b);
    let (r, code, report) = m.umount(&place);
    assert_eq!((r.code, code), (0, 0), "{r:?} {}", m.log_text());
    assert_eq!(n(&report, "read_failures"), 0, "{report}");
}

/// `--prefetch trace`: the fill takes the memory file's recorded trace first (a trace a
/// lazy restore recorded in a registry), and the files read right.
#[test]
fn the_fill_takes_the_recorded_trace_first() {
    if !mount_usable() || !snapctl_tests::uffd_usable() {
        return;
    }
    let rec = crate::lazy::recorded_in_a_registry("9", &[]);
    let place = Place::new();
    let dir = place.dir("d");
    let mut m = Mounted::start(&place, &rec.image, &dir, &["--prefetch", "trace"]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !m.log_text().contains("fill done") {
        assert!(Instant::now() < deadline, "no fill: {}", m.log_text());
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = m.log_text();
    let traced: u64 = log.split(" of them first from its trace").next().and_then(|s| s.rsplit(' ').next()).and_then(|n| n.parse().ok()).unwrap_or(0);
    assert!(traced > 0, "the trace leads the fill: {log}");
    assert!(fs::read(dir.join("vm.mem")).unwrap() == fs::read(&rec.mem).unwrap());
    let (_, code, report) = m.umount(&place);
    assert_eq!(code, 0);
    assert!(n(&report, "filled_chunks") > 0 && n(&report, "read_failures") == 0, "{report}");
}

/// `--daemon` returns once DIR shows the image; SIGTERM to a foreground mount unmounts DIR
/// only once its open file is closed.
#[test]
fn daemon_returns_once_mounted_and_sigterm_waits_for_open_files() {
    if !mount_usable() {
        return;
    }
    let place = Place::new();
    let (snap, image) = sampled(&place, "4MiB", 12, &[], &[]);
    let dir = place.dir("d");
    let r = run(place.snapctl().args(["mount", &image]).arg(&dir).arg("--cache").arg(place.cache()).arg("--daemon"));
    assert_eq!(r.code, 0, "{r:?}");
    assert!(mounted_at(&dir).is_some(), "DIR shows the image when --daemon returns");
    assert!(fs::read(dir.join("vm.mem")).unwrap() == fs::read(snap.join("vm.mem")).unwrap());
    let r = run(place.snapctl().args(["umount", "--json"]).arg(&dir));
    assert_eq!(r.code, 0, "{r:?}");
    let report: Value = serde_json::from_str(r.stdout.trim()).unwrap();
    assert_eq!(n(&report, "read_failures"), 0, "{report}");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !mounts_under(place.path()).is_empty() {
        assert!(Instant::now() < deadline, "the daemon did not end with its last DIR: {:?}", mounts_under(place.path()));
        std::thread::sleep(Duration::from_millis(20));
    }

    let mut m = Mounted::start(&place, &image, &dir, &[]);
    let f = fs::File::open(dir.join("vm.state")).unwrap();
    // SAFETY: kill sends a signal to our own child; no memory is involved.
    assert_eq!(unsafe { libc::kill(m.child.id() as i32, libc::SIGTERM) }, 0);
    std::thread::sleep(Duration::from_millis(500));
    assert!(m.child.try_wait().unwrap().is_none() && mounted_at(&dir).is_some(), "a file is open: DIR stays");
    drop(f);
    let (code, report) = m.finish(Duration::from_secs(20));
    assert_eq!(code, 0, "{}", m.log_text());
    assert_eq!(report["dir"], dir.to_str().unwrap(), "{report}");
    assert!(mounts_under(place.path()).is_empty());
}

/// Issue 38 §3: while an image is mounted its chunks are pinned in the host cache, so
/// `snapctl cache prune --all` beside the mount keeps every one (the kernel may drop its page
/// cache and read again at any time). A new mount then reads every byte with nothing fetched;
/// once nothing is mounted the pin is gone and prune --all empties the cache.
#[test]
fn regression_issue_38_a_mounted_images_chunks_stay_in_the_cache_through_prune_all() {
    if !mount_usable() {
        return;
    }
    let place = Place::new();
    let (snap, image) = sampled(&place, "8MiB", 13, &[], &[]);
    let want = stored_chunks(&place.path().join("layout"), "v1", "vm.mem");
    let cache = place.cache();
    let cache_cmd = |args: &[&str]| -> Value {
        let r = run(snapctl().arg("cache").arg("--cache").arg(&cache).args(args).arg("--json"));
        assert_eq!(r.code, 0, "{r:?}");
        serde_json::from_str(&r.stdout).unwrap()
    };
    let entries = |u: &Value| u["kinds"][0]["entries"].as_u64().unwrap_or(0);
    let dir = place.dir("d");
    let mut m = Mounted::start(&place, &image, &dir, &["--prefetch", "all"]);
    let deadline = Instant::now() + Duration::from_secs(60);
    while !m.log_text().contains("fill done") || entries(&cache_cmd(&[])) < want {
        assert!(Instant::now() < deadline, "the fill never put the image in the cache: {}", m.log_text());
        std::thread::sleep(Duration::from_millis(50));
    }
    let u = cache_cmd(&["prune", "--all"]);
    assert!(entries(&u) >= want, "prune --all beside a mount deleted its chunks: {u}");
    assert_eq!(u["pins"].as_u64(), Some(1), "{u}");
    assert!(fs::read(dir.join("vm.mem")).unwrap() == fs::read(snap.join("vm.mem")).unwrap());
    let (_, code, _) = m.umount(&place);
    assert_eq!(code, 0);

    let mut m = Mounted::start(&place, &image, &dir, &["--prefetch", "none"]);
    assert!(fs::read(dir.join("vm.mem")).unwrap() == fs::read(snap.join("vm.mem")).unwrap());
    let (_, code, report) = m.umount(&place);
    assert_eq!(code, 0);
    assert_eq!(n(&report, "fetched_chunks"), 0, "every chunk from the cache the prune left: {report}");
    let u = cache_cmd(&["prune", "--all"]);
    assert_eq!((u["pins"].as_u64(), entries(&u)), (Some(0), 0), "nothing mounted, nothing pinned: {u}");
}

/// Wait until the daemon's log (`m`'s, the process that runs the host mount) says `what`
/// `times` times.
fn wait_for_log(m: &Mounted, what: &str, times: usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while m.log_text().matches(what).count() < times {
        assert!(Instant::now() < deadline, "the log never said {what:?} {times} times: {}", m.log_text());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// What the daemon logs when a file's whole-file copy is ready.
const COPY_READY: &str = "complete: later opens are served by FUSE passthrough";

/// The directories of whole-file copies under a cache (one per running host daemon).
fn copy_dirs(cache: &Path) -> Vec<PathBuf> {
    let Ok(rd) = fs::read_dir(cache.join("mount-files")) else { return Vec::new() };
    rd.map(|e| e.unwrap().path()).filter(|p| p.is_dir()).collect()
}

/// Once the fill is done every file is served by FUSE passthrough from its whole-file copy:
/// every byte right by read and by mmap, no read reaching the daemon; the copies are
/// private, sparse, and gone with the mount.
#[test]
fn regression_issue_38_a_filled_file_is_read_through_passthrough_by_read_and_mmap() {
    if !mount_usable() {
        return;
    }
    let place = Place::new();
    let src = place.path().join("src");
    write_patterns(&src);
    let image = pack(&place, &src, "v1", &["--chunk-size", "256KiB"]);
    let dir = place.dir("d");
    let mut m = Mounted::start(&place, &image, &dir, &["--prefetch", "all"]);
    assert!(m.log_text().contains("passthrough on"), "{}", m.log_text());
    wait_for_log(&m, COPY_READY, PATTERN_FILES.len());

    let copies = copy_dirs(&place.cache());
    assert_eq!(copies.len(), 1, "one daemon's copies: {copies:?}");
    let mode = |p: &Path| fs::symlink_metadata(p).unwrap().mode() & 0o777;
    assert_eq!((mode(&place.cache().join("mount-files")), mode(&copies[0])), (0o700, 0o700));
    let files: Vec<PathBuf> = fs::read_dir(&copies[0]).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(files.len(), PATTERN_FILES.len(), "one copy per content: {files:?}");
    for f in &files {
        assert_eq!(mode(f), 0o600, "{}", f.display());
    }
    let zero = files.iter().find(|f| fs::metadata(f).unwrap().len() == 3 * MIB + 5).expect("zero.img's copy");
    assert_eq!(fs::metadata(zero).unwrap().blocks(), 0, "zero chunks are holes in the copy");

    for name in PATTERN_FILES {
        let (want, path) = (fs::read(src.join(name)).unwrap(), dir.join(name));
        reads_right(&path, &want, name);
    }
    let (r, code, report) = m.umount(&place);
    assert_eq!((r.code, code), (0, 0), "{r:?} {}", m.log_text());
    let opens = 3 * PATTERN_FILES.len() as u64;
    assert_eq!((n(&report, "opens"), n(&report, "passthrough_files")), (opens, opens), "every open by passthrough: {report}");
    assert_eq!(n(&report, "reads"), 0, "no read reached the daemon: {report}");
    assert_eq!((n(&report, "read_failures"), n(&report, "passthrough_refused")), (0, 0), "{report}");
    assert_eq!(fs::read_dir(place.cache().join("mount-files")).unwrap().count(), 0, "the copies went with the mount");
}

/// An open served by the daemon before the file's copy was ready keeps later opens of that
/// inode on the daemon (the kernel fails an open whose mode differs from the inode's other
/// opens with EIO): right bytes by read and through a mapping held across; passthrough
/// starts once those opens are closed. A second `snapctl mount` joining the host mount
/// keeps the host's --passthrough and says so.
#[test]
fn regression_issue_38_an_open_held_before_the_copy_keeps_later_opens_on_the_daemon() {
    use std::os::fd::AsRawFd;
    if !mount_usable() {
        return;
    }
    let place = Place::new();
    let (snap, image1) = sampled(&place, "8MiB", 41, &[], &[]);
    // A second image with the same vm.mem (so the same inode) and a vm.state of its own.
    let snap2 = place.path().join("snap2");
    fs::create_dir_all(&snap2).unwrap();
    fs::copy(snap.join("vm.mem"), snap2.join("vm.mem")).unwrap();
    let mut state = fs::read(snap.join("vm.state")).unwrap();
    state.push(1);
    fs::write(snap2.join("vm.state"), &state).unwrap();
    let image2 = pack(&place, &snap2, "v2", &[]);
    let want = fs::read(snap.join("vm.mem")).unwrap();

    let (d1, d2) = (place.dir("d1"), place.dir("d2"));
    let mut m1 = Mounted::start(&place, &image1, &d1, &["--prefetch", "none"]);
    let held = fs::File::open(d1.join("vm.mem")).unwrap();
    let len = want.len();
    // SAFETY: a fresh private read-only mapping of a file we opened, unmapped below.
    let map = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_PRIVATE, held.as_raw_fd(), 0) };
    assert_ne!(map, libc::MAP_FAILED);
    drop(held);
    // SAFETY: `len` bytes are mapped at `map` until the munmap below.
    let mapped_bytes = || unsafe { std::slice::from_raw_parts(map as *const u8, len) }.to_vec();
    assert!(mapped_bytes()[..MIB as usize] == want[..MIB as usize]);

    let mut m2 = Mounted::start(&place, &image2, &d2, &["--prefetch", "all", "--passthrough", "off"]);
    // The host's setting is kept, and said.
    wait_for_log(&m2, "--passthrough off not applied", 1);
    wait_for_log(&m1, &format!("vm.mem: {COPY_READY}"), 1);

    // The copy is ready, the mapping still holds a cached open: new opens stay cached.
    let f = fs::File::open(d1.join("vm.mem")).unwrap();
    let mut all = vec![0u8; len];
    f.read_exact_at(&mut all, 0).expect("no EIO while a cached open lasts");
    assert!(all == want, "read through the daemon while the mapping lasts");
    assert!(fs::read(d2.join("vm.mem")).unwrap() == want, "the same inode through the other image");
    assert!(mapped_bytes() == want, "the mapping made before the copy reads right");
    drop(f);
    // SAFETY: unmapping what we mapped; no slice of it is alive.
    unsafe { libc::munmap(map, len) };
    place.wait_all_closed();

    // Every cached open closed: the next ones are served by passthrough.
    assert!(fs::read(d1.join("vm.mem")).unwrap() == want);
    assert!(mapped(&d1.join("vm.mem")) == want);
    let (r, _, _) = m2.umount(&place);
    assert_eq!(r.code, 0, "{r:?}");
    let (r, code, report) = m1.umount(&place);
    assert_eq!((r.code, code), (0, 0), "{r:?} {}", m1.log_text());
    assert_eq!((n(&report, "opens"), n(&report, "passthrough_files")), (5, 2), "three opens cached, the last two by passthrough: {report}");
    assert_eq!(n(&report, "read_failures"), 0, "{report}");
}

/// `--passthrough off`: every open and read through the daemon, right bytes, no copies.
#[test]
fn regression_issue_38_passthrough_off_serves_every_read_through_the_daemon() {
    if !mount_usable() {
        return;
    }
    let place = Place::new();
    let (snap, image) = sampled(&place, "8MiB", 42, &[], &[]);
    let dir = place.dir("d");
    let mut m = Mounted::start(&place, &image, &dir, &["--prefetch", "all", "--passthrough", "off"]);
    wait_for_log(&m, "fill done", 1);
    assert!(m.log_text().contains("passthrough off (--passthrough off)"), "the log says which path and why: {}", m.log_text());
    let want = fs::read(snap.join("vm.mem")).unwrap();
    assert!(fs::read(dir.join("vm.mem")).unwrap() == want);
    assert!(mapped(&dir.join("vm.mem")) == want);
    let (_, code, report) = m.umount(&place);
    assert_eq!(code, 0, "{}", m.log_text());
    assert_eq!(n(&report, "passthrough_files"), 0, "{report}");
    assert!(n(&report, "reads") > 0, "{report}");
    assert!(!m.log_text().contains(COPY_READY) && copy_dirs(&place.cache()).is_empty(), "no copies: {}", m.log_text());
}

/// A killed daemon leaves its whole-file copies; the next host mount removes them.
#[test]
fn regression_issue_38_a_killed_daemons_copies_are_swept_by_the_next_host_mount() {
    if !mount_usable() {
        return;
    }
    let place = Place::new();
    let (snap, image) = sampled(&place, "4MiB", 43, &[], &[]);
    let dir = place.dir("d");
    let mut m = Mounted::start(&place, &image, &dir, &["--prefetch", "all"]);
    wait_for_log(&m, &format!("vm.mem: {COPY_READY}"), 1);
    let dead = copy_dirs(&place.cache());
    assert_eq!(dead.len(), 1, "{dead:?}");
    m.child.kill().unwrap();
    m.child.wait().unwrap();
    assert!(dead[0].is_dir(), "a killed daemon cannot remove its copies");
    assert_eq!(run(place.snapctl().arg("umount").arg(&dir)).code, 0);

    // The cache holds the image whole: the new daemon copies it at once.
    let mut m = Mounted::start(&place, &image, &dir, &["--prefetch", "none"]);
    assert!(!dead[0].exists(), "the dead daemon's copies are swept when a host mount starts");
    wait_for_log(&m, &format!("vm.mem: {COPY_READY}"), 1);
    assert!(fs::read(dir.join("vm.mem")).unwrap() == fs::read(snap.join("vm.mem")).unwrap());
    let (_, code, report) = m.umount(&place);
    assert_eq!(code, 0);
    assert_eq!((n(&report, "passthrough_files"), n(&report, "fetched_chunks")), (1, 0), "{report}");
    assert!(copy_dirs(&place.cache()).is_empty());
}
