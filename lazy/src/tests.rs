//! End to end inside one process: a userfaultfd over anonymous memory stands in for the
//! VMM, the handshake goes over the daemon's real socket, threads touch the pages.
//! Needs userfaultfd(2) (root here); skips with a note where it is refused.

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use userfaultfd::{FeatureFlags, Uffd, UffdBuilder};

use super::fetch::tests::{sample_image, Flaky};
use super::*;

const K64: usize = 64 << 10;

/// Anonymous memory registered on a userfaultfd, like a VMM's guest RAM.
pub(crate) struct Guest {
    pub(crate) uffd: Uffd,
    pub(crate) regions: Vec<(*mut u8, usize, u64)>, // (address, size, file offset)
}
// SAFETY: the raw pointers are only dereferenced inside the mappings, which live as long
// as the Guest; threads only read them.
unsafe impl Send for Guest {}
// SAFETY: as above.
unsafe impl Sync for Guest {}

impl Guest {
    pub(crate) fn new(layout: &[(usize, u64)]) -> Option<Guest> {
        let uffd = match UffdBuilder::new().close_on_exec(true).user_mode_only(false).require_features(FeatureFlags::EVENT_REMOVE).create() {
            Ok(u) => u,
            Err(e) => {
                eprintln!("skipping: userfaultfd(2) unavailable here: {e}");
                return None;
            }
        };
        let mut regions = Vec::new();
        for &(size, off) in layout {
            // SAFETY: a fresh private anonymous mapping; checked for failure below.
            let p = unsafe { libc::mmap(std::ptr::null_mut(), size, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0) };
            assert_ne!(p, libc::MAP_FAILED);
            uffd.register(p, size).expect("register MISSING");
            regions.push((p as *mut u8, size, off));
        }
        Some(Guest { uffd, regions })
    }

    fn json(&self) -> String {
        let r: Vec<String> = self
            .regions
            .iter()
            .map(|(p, s, o)| format!(r#"{{"base_host_virt_addr":{},"size":{s},"offset":{o},"page_size":4096,"page_size_kib":4096}}"#, *p as u64))
            .collect();
        format!("[{}]", r.join(","))
    }

    pub(crate) fn connect(&self, socket: &std::path::Path) -> UnixStream {
        use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
        let s = UnixStream::connect(socket).expect("connect");
        let j = self.json();
        let fds = [self.uffd.as_raw_fd()];
        sendmsg::<()>(s.as_raw_fd(), &[std::io::IoSlice::new(j.as_bytes())], &[ControlMessage::ScmRights(&fds)], MsgFlags::empty(), None).expect("sendmsg");
        s
    }

    pub(crate) fn region(&self, i: usize) -> &[u8] {
        let (p, s, _) = self.regions[i];
        // SAFETY: a live mapping of `s` bytes; reading it faults pages in through the daemon.
        unsafe { std::slice::from_raw_parts(p, s) }
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        for &(p, s, _) in &self.regions {
            // SAFETY: unmapping what `new` mapped.
            unsafe { libc::munmap(p as *mut libc::c_void, s) };
        }
    }
}

pub(crate) struct Running {
    pub(crate) daemon: Arc<Daemon>,
    pub(crate) socket: std::path::PathBuf,
    pub(crate) reports: mpsc::Receiver<ConnReport>,
    thread: Option<std::thread::JoinHandle<Result<(), LazyError>>>,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.daemon.stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn start(
    dir: &std::path::Path,
    image: Arc<Image>,
    src: Arc<dyn imgfmt::BlobSource>,
    opts: impl FnOnce(&mut LazyOptions),
    traces: Option<Box<dyn TraceStore>>,
) -> Running {
    start_with_store(dir, image, src, None, opts, traces)
}

/// [`start`] with a chunk cache.
pub(crate) fn start_with_store(
    dir: &std::path::Path,
    image: Arc<Image>,
    src: Arc<dyn imgfmt::BlobSource>,
    store: Option<Arc<dyn ChunkStore>>,
    opts: impl FnOnce(&mut LazyOptions),
    traces: Option<Box<dyn TraceStore>>,
) -> Running {
    let socket = dir.join(format!("uffd-{}.sock", rand::random::<u32>()));
    let mut o = LazyOptions::new(socket.clone());
    o.retry = RetryPolicy { first_backoff: Duration::from_millis(1), max_backoff: Duration::from_millis(20), ..RetryPolicy::stall(Duration::from_secs(2)) };
    o.ready_file = Some(dir.join("ready"));
    let _ = std::fs::remove_file(dir.join("ready"));
    opts(&mut o);
    let file = image.file("vm.mem").unwrap().0;
    let daemon = Daemon::new(image, file, src, store, traces, o).unwrap();
    let (tx, rx) = mpsc::channel();
    let tx = Mutex::new(tx);
    let d = daemon.clone();
    let thread = std::thread::spawn(move || d.run(Arc::new(move |r: &ConnReport| tx.lock().unwrap().send(r.clone()).unwrap())));
    let t0 = Instant::now();
    while !dir.join("ready").exists() {
        assert!(t0.elapsed() < Duration::from_secs(10), "daemon never became ready");
        std::thread::sleep(Duration::from_millis(5));
    }
    Running { daemon, socket, reports: rx, thread: Some(thread) }
}

pub(crate) fn flaky(layout: imgfmt::OciLayout) -> Arc<Flaky> {
    Arc::new(Flaky { inner: Box::new(layout), reads: 0.into(), bytes: 0.into(), fail: 0.into(), corrupt: false.into(), delay: Duration::ZERO })
}

#[test]
fn restore_touch_every_page_remove_and_trace() {
    // 48 chunks of 64 KiB (3 MiB); region 1 starts mid-chunk (chunk 16), after a gap.
    let (dir, mem, image, layout) = sample_image(48);
    let split = 16 * K64 + 32 * 1024;
    let Some(guest) = Guest::new(&[(split, 0), (mem.len() - split, split as u64)]) else { return };
    let src = flaky(layout);
    let traces = LayoutTraces(imgfmt::OciLayout::open(dir.path().join("layout")).unwrap());
    let run = start(
        dir.path(),
        image.clone(),
        src.clone(),
        |o| {
            o.record_trace = true;
            o.prefetch = PrefetchMode::None;
        },
        Some(Box::new(traces)),
    );
    let sock = guest.connect(&run.socket);
    let guest = Arc::new(guest);

    // Four threads touch every page, in different orders, and check each byte.
    let hs: Vec<_> = (0..4)
        .map(|t| {
            let (g, mem) = (guest.clone(), mem.clone());
            std::thread::spawn(move || {
                for (ri, &(_, size, off)) in g.regions.iter().enumerate() {
                    let r = g.region(ri);
                    let pages = size / 4096;
                    for k in 0..pages {
                        let p = if t % 2 == 0 { k } else { pages - 1 - k };
                        let at = p * 4096;
                        assert!(r[at..at + 4096] == mem[off as usize + at..off as usize + at + 4096], "region {ri} page {p}");
                    }
                }
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
    let nonzero = (0..48).filter(|c| c % 3 != 1).count() as u64;
    assert_eq!(src.reads.load(Ordering::SeqCst), nonzero, "each non-zero chunk read once; zero chunks never");

    // The guest gives back 3 pages of chunk 2 (balloon): they read as zeros afterwards.
    let (p0, _, _) = guest.regions[0];
    // SAFETY: inside region 0, page-aligned.
    let rc = unsafe { libc::madvise(p0.add(2 * K64 + 8192) as *mut libc::c_void, 3 * 4096, libc::MADV_DONTNEED) };
    assert_eq!(rc, 0);
    let r0 = guest.region(0);
    assert!(r0[2 * K64 + 8192..2 * K64 + 8192 + 3 * 4096].iter().all(|&b| b == 0), "removed pages read as zeros");
    assert_eq!(r0[2 * K64..2 * K64 + 8192], mem[2 * K64..2 * K64 + 8192], "pages beside them keep their data");

    drop(sock);
    let rep = run.reports.recv_timeout(Duration::from_secs(10)).expect("a report when the peer goes");
    assert_eq!(rep.pid, std::process::id() as i32);
    assert_eq!(rep.faults.fetched, nonzero);
    assert!(rep.faults.zero >= 16, "{rep:?}");
    assert_eq!(rep.removed_ranges, 1);
    assert!(rep.removed_faults >= 1, "{rep:?}");
    assert_eq!((rep.verify_failures, rep.poisoned_pages), (0, 0));
    assert_eq!(rep.bytes_fetched, nonzero * K64 as u64);
    assert!(rep.latency_us.max >= rep.latency_us.p50);
    let at = rep.trace.clone().expect("trace stored");
    assert!(at.contains("sha256-"), "{at}");
    let stored = LayoutTraces(imgfmt::OciLayout::open(dir.path().join("layout")).unwrap()).load(&image, image.file("vm.mem").unwrap().0).unwrap().unwrap();
    assert_eq!(stored.chunks.len() as u64, nonzero);
    assert!(run.daemon.metrics_text().contains(&format!("snapctl_lazy_faults_total{{kind=\"fetched\"}} {nonzero}")));
}

#[test]
fn tampered_pack_poisons_never_serves_wrong_bytes() {
    let (dir, mem, image, layout) = sample_image(6);
    let Some(guest) = Guest::new(&[(mem.len(), 0)]) else { return };
    let src = flaky(layout);
    src.corrupt.store(true, Ordering::SeqCst);
    let run = start(dir.path(), image, src.clone(), |o| o.prefetch = PrefetchMode::None, None);
    let sock = guest.connect(&run.socket);
    // Read through process_vm_readv: a poisoned page is EFAULT there, not a SIGBUS.
    let (p, _, _) = guest.regions[0];
    let mut buf = vec![0u8; 4096];
    let local = libc::iovec { iov_base: buf.as_mut_ptr() as *mut libc::c_void, iov_len: 4096 };
    let remote = libc::iovec { iov_base: p as *mut libc::c_void, iov_len: 4096 };
    // SAFETY: both iovecs describe live memory of this process.
    let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
    assert_eq!(n, -1, "a chunk that fails verification must not be readable");
    assert!(buf.iter().all(|&b| b == 0));
    // Zero chunks need no source and still work.
    assert!(guest.region(0)[K64..2 * K64].iter().all(|&b| b == 0));
    drop(sock);
    let rep = run.reports.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(rep.verify_failures, 2, "{rep:?}");
    assert_eq!(rep.poisoned_pages, (K64 / 4096) as u64);
    assert!(rep.integrity_failed());
}

#[test]
fn transient_failures_are_retried_and_bad_handshakes_do_not_kill_the_daemon() {
    let (dir, mem, image, layout) = sample_image(6);
    let Some(guest) = Guest::new(&[(mem.len(), 0)]) else { return };
    let data_bytes = stored(&image, 0..6);
    let src = flaky(layout);
    src.fail.store(3, Ordering::SeqCst);
    let run = start(dir.path(), image, src.clone(), |o| o.prefetch = PrefetchMode::All, None);
    // Bad JSON, then a region that does not fit the file: each closes its connection only.
    {
        use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
        for j in ["nonsense", r#"[{"base_host_virt_addr":4096,"size":1073741824,"offset":0,"page_size":4096}]"#] {
            let s = UnixStream::connect(&run.socket).unwrap();
            let fds = [guest.uffd.as_raw_fd()];
            sendmsg::<()>(s.as_raw_fd(), &[std::io::IoSlice::new(j.as_bytes())], &[ControlMessage::ScmRights(&fds)], MsgFlags::empty(), None).unwrap();
            let mut b = [0u8; 1];
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            assert_eq!(std::io::Read::read(&mut &s, &mut b).unwrap(), 0, "the daemon closes a bad connection");
        }
    }
    let sock = guest.connect(&run.socket);
    assert!(guest.region(0) == &mem[..], "every byte right despite 3 injected failures");
    drop(sock);
    let rep = run.reports.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(rep.retries, 3, "{rep:?}");
    assert_eq!((rep.verify_failures, rep.poisoned_pages), (0, 0));
    // With --prefetch all, the prefetcher and the faults together fetched each chunk once.
    assert_eq!(src.bytes.load(Ordering::SeqCst), data_bytes);
}

#[test]
fn recorded_trace_is_replayed_by_the_next_restore_and_metrics_are_served() {
    let (dir, mem, image, layout) = sample_image(24);
    let traces = || -> Option<Box<dyn TraceStore>> { Some(Box::new(LayoutTraces(imgfmt::OciLayout::open(dir.path().join("layout")).unwrap()))) };
    // First restore: touch a few chunks, in an order, and record it.
    let order = [8usize, 2, 20, 9]; // (chunks c % 3 == 1 are zero: never traced)
    {
        let Some(guest) = Guest::new(&[(mem.len(), 0)]) else { return };
        let run = start(
            dir.path(),
            image.clone(),
            flaky(layout),
            |o| {
                o.record_trace = true;
                o.prefetch = PrefetchMode::None;
            },
            traces(),
        );
        let sock = guest.connect(&run.socket);
        for &c in &order {
            assert_eq!(guest.region(0)[c * K64 + 100], mem[c * K64 + 100]);
        }
        drop(sock);
        let rep = run.reports.recv_timeout(Duration::from_secs(10)).unwrap();
        assert!(rep.trace.is_some(), "{rep:?}");
    }
    let file = image.file("vm.mem").unwrap().0;
    let t = traces().unwrap().load(&image, file).unwrap().expect("a trace");
    assert_eq!(t.chunks, order.iter().map(|&c| c as u64).collect::<Vec<_>>());

    // Second restore: the daemon installs the traced chunks before the guest asks.
    let Some(guest) = Guest::new(&[(mem.len(), 0)]) else { return };
    let src = flaky(imgfmt::OciLayout::open(dir.path().join("layout")).unwrap());
    let run = start(
        dir.path(),
        image.clone(),
        src.clone(),
        |o| {
            o.prefetch = PrefetchMode::Trace;
            // The trace alone: the guest below touches everything, which would start the
            // stream of the rest.
            o.stream_after = None;
        },
        traces(),
    );
    assert!(run.daemon.has_trace());
    let addr = run.daemon.serve_metrics("127.0.0.1:0").unwrap();
    let sock = guest.connect(&run.socket);
    let t0 = Instant::now();
    while !run.daemon.metrics_text().contains(&format!("snapctl_lazy_prefetched_chunks_total {}", order.len())) {
        assert!(t0.elapsed() < Duration::from_secs(10), "prefetch never ran");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(guest.region(0) == &mem[..]);
    drop(sock);
    let rep = run.reports.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(rep.prefetched_chunks, order.len() as u64, "{rep:?}");
    let nonzero = (0..24).filter(|c| c % 3 != 1).count() as u64;
    assert_eq!(src.reads.load(Ordering::SeqCst), nonzero, "prefetched chunks are not fetched again");

    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.contains(&format!("snapctl_lazy_prefetched_chunks_total {}", order.len())), "{text}");
    assert!(text.contains("snapctl_lazy_connections_total 1"), "{text}");
}

#[test]
fn regression_remove_before_first_touch_keeps_the_rest_of_the_chunk() {
    // The guest gives back pages of a chunk that was never faulted, then touches them: they
    // read as zeros, and the chunk's other pages must still read as the snapshot (a fault
    // in removed memory once zero-filled the whole chunk).
    let (dir, mem, image, layout) = sample_image(6);
    let Some(guest) = Guest::new(&[(mem.len(), 0)]) else { return };
    let run = start(dir.path(), image, flaky(layout), |o| o.prefetch = PrefetchMode::None, None);
    let sock = guest.connect(&run.socket);
    let (p0, _, _) = guest.regions[0];
    let (at, len) = (2 * K64 + 8192, 2 * 4096);
    // SAFETY: inside the region, page-aligned.
    assert_eq!(unsafe { libc::madvise(p0.add(at) as *mut libc::c_void, len, libc::MADV_DONTNEED) }, 0);
    let r = guest.region(0);
    assert!(r[at..at + len].iter().all(|&b| b == 0), "removed pages read as zeros");
    assert_eq!(r[2 * K64..at], mem[2 * K64..at], "pages before them are the snapshot's");
    assert_eq!(r[at + len..3 * K64], mem[at + len..3 * K64], "pages after them are the snapshot's");
    drop(sock);
    let rep = run.reports.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!((rep.removed_ranges, rep.faults.fetched), (1, 1), "{rep:?}");
}

/// Issue 14 §9: the socket is 0600 whatever the umask (it is created in a private
/// directory, which is removed), it never replaces a file that is not a stale socket,
/// and a peer of the daemon's own user is admitted.
#[test]
fn regression_issue_14_socket_is_private_and_replaces_nothing() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("vm.sock");
    let (l, guard) = listen(&path, None, "daemon", "").unwrap();
    assert_eq!(std::fs::symlink_metadata(&path).unwrap().permissions().mode() & 0o7777, 0o600);
    let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().flatten().map(|e| e.file_name()).collect();
    assert_eq!(names, vec![std::ffi::OsString::from("vm.sock")], "nothing else left behind");
    // The socket moved after bind still answers, and our own user is admitted.
    let _c = UnixStream::connect(&path).unwrap();
    l.set_nonblocking(false).unwrap();
    let (s, _) = l.accept().unwrap();
    assert!(admit(&s, &LazyOptions::new(path.clone())));
    drop((l, guard));
    assert!(!path.exists(), "the guard removes the socket");

    let file = dir.path().join("not-a-socket");
    std::fs::write(&file, b"keep me").unwrap();
    assert!(listen(&file, None, "daemon", "").is_err());
    assert_eq!(std::fs::read(&file).unwrap(), b"keep me");
}

#[test]
fn peers_allowed_by_user_or_group() {
    let mut o = LazyOptions::new("s".into());
    assert!(peer_allowed(1000, 1000, 1000, &o), "the daemon's own user");
    assert!(peer_allowed(0, 0, 0, &o), "root, when the daemon is root");
    assert!(!peer_allowed(0, 0, 1000, &o), "root is not the daemon's user");
    assert!(!peer_allowed(65534, 65534, 0, &o), "another user");
    o.allow_uids = vec![123];
    o.allow_gids = vec![456];
    assert!(peer_allowed(123, 1, 0, &o));
    assert!(peer_allowed(7, 456, 0, &o));
    assert!(!peer_allowed(7, 8, 0, &o));
}

/// The sample image with its outboards loaded, so data faults can fetch slices.
pub(crate) fn with_outboards(image: Arc<Image>, layout: &imgfmt::OciLayout) -> Arc<Image> {
    let Ok(mut img) = Arc::try_unwrap(image) else { panic!("the image is shared") };
    img.load_outboards(layout).unwrap();
    Arc::new(img)
}

/// Issue 16 §3 (`--slice-faults on`): a chunk's first miss in a raw BLAKE3 chunk fetches
/// the 4 KiB slice it needs and, beside it, the whole chunk; the slice serves the fault a
/// round trip early, the chunk is installed when it arrives, so the guest's later touches
/// there do not fault. Every byte the guest reads is the snapshot's.
#[test]
fn regression_issue_16_scattered_faults_fetch_slices_not_chunks() {
    let (dir, mem, image, layout) = sample_image(24);
    let image = with_outboards(image, &layout);
    let file = image.file("vm.mem").unwrap().0;
    assert!(image.slice_cvs(file, 0).is_some(), "the sample is raw BLAKE3 with an outboard");
    let Some(guest) = Guest::new(&[(mem.len(), 0)]) else { return };
    // Every read takes 30 ms, as across a network: the slice and the chunk are both asked
    // for before either arrives.
    let src = slow(imgfmt::OciLayout::open(dir.path().join("layout")).unwrap(), Duration::from_millis(30));
    drop(layout);
    let run = start(
        dir.path(),
        image,
        src.clone(),
        |o| {
            o.prefetch = PrefetchMode::None;
            o.slice_faults = true;
        },
        None,
    );
    let sock = guest.connect(&run.socket);
    let r = guest.region(0);
    let page = |c: usize, p: usize| c * K64 + p * 4096;
    // One page in each of four data chunks (c % 3 == 1 are zero chunks).
    for c in [0usize, 3, 6, 9] {
        let at = page(c, 5);
        assert_eq!(r[at..at + 4096], mem[at..at + 4096], "chunk {c}");
    }
    // Each chunk arrives beside its slice and is installed: the rest of it is present.
    let (p0, _, _) = guest.regions[0];
    wait_for("the chunks installed beside their slices", || {
        let present = resident(p0, mem.len());
        [0usize, 3, 6, 9].iter().all(|&c| present[c * 16..(c + 1) * 16].iter().all(|&x| x))
    });
    assert_eq!(src.reads.load(Ordering::SeqCst), 8, "a slice and its chunk per first miss");
    assert_eq!(r[page(0, 0)..page(1, 0)], mem[page(0, 0)..page(1, 0)]);
    assert_eq!(src.reads.load(Ordering::SeqCst), 8, "the rest of chunk 0 needed nothing more");
    // A chunk can arrive before its slice (a busy host), and its install wakes the guest:
    // the slice's fetch is then still on its way. The connection ends once every fetch
    // is in (its bytes counted, its faults served).
    wait_for("every fetch accounted", || metric(&run.daemon, "snapctl_lazy_bytes_fetched_total") >= 4 * 4096 + 4 * K64 as u64);
    drop(sock);
    let rep = run.reports.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(rep.bytes_fetched, 4 * 4096 + 4 * K64 as u64, "{rep:?}");
    assert_eq!(rep.slice_bytes, 4 * 4096, "{rep:?}");
    assert_eq!((rep.verify_failures, rep.poisoned_pages), (0, 0));
    assert_eq!(rep.faults.fetched + rep.faults.cache_hit + rep.faults.present, 4, "{rep:?}");
}

/// A cold restore that only serves faults listens before the outboards are in (issue 23
/// §3, wake): its faults fetch whole chunks until then, and slices once they are attached
/// to the shared image.
#[test]
fn regression_issue_23_faults_fetch_whole_chunks_until_the_outboards_are_attached() {
    let (dir, mem, image, layout) = sample_image(24);
    let file = image.file("vm.mem").unwrap().0;
    assert!(image.slice_cvs(file, 0).is_none(), "opened without its outboards");
    let Some(guest) = Guest::new(&[(mem.len(), 0)]) else { return };
    let src = slow(imgfmt::OciLayout::open(dir.path().join("layout")).unwrap(), Duration::from_millis(30));
    let run = start(
        dir.path(),
        image.clone(),
        src.clone(),
        |o| {
            o.prefetch = PrefetchMode::None;
            o.slice_faults = true;
        },
        None,
    );
    let sock = guest.connect(&run.socket);
    let r = guest.region(0);
    let at = |c: usize| c * K64 + 5 * 4096;
    assert_eq!(r[at(0)..at(0) + 4096], mem[at(0)..at(0) + 4096]);
    assert_eq!(src.reads.load(Ordering::SeqCst), 1, "the whole chunk: no slices yet");
    assert!(image.attach_outboards(image.read_all_outboards(&layout).unwrap()));
    assert!(!image.attach_outboards(image.read_all_outboards(&layout).unwrap()), "once");
    assert!(image.slice_cvs(file, 3).is_some());
    assert_eq!(r[at(3)..at(3) + 4096], mem[at(3)..at(3) + 4096]);
    wait_for("every fetch accounted", || metric(&run.daemon, "snapctl_lazy_bytes_fetched_total") >= 4096 + 2 * K64 as u64);
    assert_eq!(src.reads.load(Ordering::SeqCst), 3, "then a slice and its chunk");
    drop(sock);
    let rep = run.reports.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!((rep.bytes_fetched, rep.slice_bytes), (4096 + 2 * K64 as u64, 4096), "{rep:?}");
    assert_eq!((rep.verify_failures, rep.poisoned_pages), (0, 0));
}

/// Issue 16 §3: a byte flipped inside one slice of a raw pack fails closed like a tampered
/// chunk: the slice is fetched twice, then its span is poisoned; the guest never sees the
/// byte. A slice fetched before it, verified, keeps its right bytes.
#[test]
fn regression_issue_16_tampered_slice_poisons_never_serves_wrong_bytes() {
    use std::os::unix::fs::FileExt;
    let (dir, mem, image, layout) = sample_image(6);
    let image = with_outboards(image, &layout);
    let file = image.file("vm.mem").unwrap().0;
    // Flip a byte 100 bytes into slice 3 of chunk 2.
    let imgfmt::StoredAt::Pack { pack, offset, .. } = image.files[file].chunks[2].at else { panic!("chunk 2 is stored") };
    let at = offset + 3 * 4096 + 100;
    let blob = std::fs::OpenOptions::new().read(true).write(true).open(layout.blob_path(&image.packs[pack as usize].digest)).unwrap();
    let mut b = [0u8; 1];
    blob.read_exact_at(&mut b, at).unwrap();
    blob.write_all_at(&[b[0] ^ 0x01], at).unwrap();
    drop(layout);
    let Some(guest) = Guest::new(&[(mem.len(), 0)]) else { return };
    let src = flaky(imgfmt::OciLayout::open(dir.path().join("layout")).unwrap());
    let run = start(
        dir.path(),
        image,
        src,
        |o| {
            o.prefetch = PrefetchMode::None;
            o.slice_faults = true;
        },
        None,
    );
    let sock = guest.connect(&run.socket);
    let (p, _, _) = guest.regions[0];
    // Slice 1 of chunk 2 is intact: served, verified.
    let good = 2 * K64 + 4096;
    assert_eq!(guest.region(0)[good..good + 4096], mem[good..good + 4096]);
    // Slice 3 is not: through process_vm_readv a poisoned page is EFAULT, not a SIGBUS.
    let bad = 2 * K64 + 3 * 4096;
    let mut buf = vec![0u8; 4096];
    let local = libc::iovec { iov_base: buf.as_mut_ptr() as *mut libc::c_void, iov_len: 4096 };
    // SAFETY: inside the live guest mapping.
    let remote = libc::iovec { iov_base: unsafe { p.add(bad) } as *mut libc::c_void, iov_len: 4096 };
    // SAFETY: both iovecs describe live memory of this process.
    let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
    assert_eq!(n, -1, "a slice that fails verification must not be readable");
    assert!(buf.iter().all(|&b| b == 0));
    // The verified slice installed before keeps its bytes; other chunks still work.
    assert_eq!(guest.region(0)[good..good + 4096], mem[good..good + 4096]);
    assert_eq!(guest.region(0)[..4096], mem[..4096]);
    drop(sock);
    let rep = run.reports.recv_timeout(Duration::from_secs(10)).unwrap();
    // The slices' fetches and the whole chunk's (beside the first slice) both fail twice.
    assert!(rep.verify_failures >= 2, "{rep:?}");
    // The span is poisoned except the page already installed.
    assert_eq!(rep.poisoned_pages, (K64 / 4096) as u64 - 1, "{rep:?}");
    assert!(rep.integrity_failed());
}

/// A source that counts the reads in flight at once and the most there ever were, each
/// read taking `delay` (as does a size query: the round trip the stream is sized from),
/// a read at pack offset `slow.0` taking `slow.1`.
struct Gauge {
    inner: imgfmt::OciLayout,
    delay: Duration,
    slow: Option<(u64, Duration)>,
    reads: AtomicU64,
    /// Bytes asked for, over every read.
    bytes: AtomicU64,
    now: AtomicU64,
    most: AtomicU64,
}
use std::sync::atomic::AtomicU64;

impl Gauge {
    fn new(inner: imgfmt::OciLayout, delay: Duration) -> Arc<Gauge> {
        Arc::new(Gauge { inner, delay, slow: None, reads: 0.into(), bytes: 0.into(), now: 0.into(), most: 0.into() })
    }
}

impl imgfmt::source::Forward for Gauge {
    fn inner(&self) -> &dyn imgfmt::BlobSource {
        &self.inner
    }
    fn describe(&self) -> String {
        "gauge".into()
    }
    fn blob_size(&self, d: &imgfmt::OciDigest) -> Result<u64, imgfmt::FormatError> {
        std::thread::sleep(self.delay);
        self.inner.blob_size(d)
    }
    fn read_at_unverified(&self, d: &imgfmt::OciDigest, o: u64, buf: &mut [u8]) -> Result<(), imgfmt::FormatError> {
        let n = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(n, Ordering::SeqCst);
        self.reads.fetch_add(1, Ordering::SeqCst);
        self.bytes.fetch_add(buf.len() as u64, Ordering::SeqCst);
        std::thread::sleep(match self.slow {
            Some((at, d)) if at == o => d,
            _ => self.delay,
        });
        let r = self.inner.read_at_unverified(d, o, buf);
        self.now.fetch_sub(1, Ordering::SeqCst);
        r
    }
}

/// Which pages of `[p, p + len)` are present (installed), by mincore(2): looking does not
/// fault them in.
pub(crate) fn resident(p: *mut u8, len: usize) -> Vec<bool> {
    let mut v = vec![0u8; len.div_ceil(4096)];
    // SAFETY: `p` is page-aligned and `[p, p + len)` a live mapping; `v` has a byte per page.
    let rc = unsafe { libc::mincore(p as *mut libc::c_void, len, v.as_mut_ptr()) };
    assert_eq!(rc, 0, "mincore");
    v.iter().map(|b| b & 1 == 1).collect()
}

/// Poll `cond` until it holds (a generous bound: this is about hanging, not speed).
pub(crate) fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(t0.elapsed() < Duration::from_secs(30), "{what}: never happened");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A daemon-wide counter from the metrics text.
pub(crate) fn metric(d: &Daemon, name: &str) -> u64 {
    let t = d.metrics_text();
    let line = t.lines().find(|l| l.strip_prefix(name).is_some_and(|r| r.starts_with(' '))).expect("metric");
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

/// The daemon-wide count of chunks the stream installed.
/// Bytes chunks `chunks` of the memory file move from the source (their stored lengths; 0
/// for a zero chunk).
fn stored(image: &imgfmt::Image, chunks: impl IntoIterator<Item = usize>) -> u64 {
    let file = image.file("vm.mem").unwrap().0;
    chunks
        .into_iter()
        .map(|c| match image.files[file].chunks[c].at {
            imgfmt::StoredAt::Pack { stored_len, .. } => u64::from(stored_len),
            imgfmt::StoredAt::Zero => 0,
        })
        .sum()
}

fn streamed(d: &Daemon) -> u64 {
    metric(d, "snapctl_lazy_streamed_chunks_total")
}

/// Issue 16 §3: `--prefetch all` streams every data chunk into guest memory before the
/// guest touches a page, each verified, each read once (in runs of adjacent chunks): a
/// chunk tampered in the pack is never installed (its pages stay missing; read once more
/// alone, then refused), and the guest's fault there is poisoned; every other page is
/// present and right.
#[test]
fn regression_issue_16_stream_installs_every_data_chunk_verified() {
    use std::os::unix::fs::FileExt;
    let (dir, mem, image, layout) = sample_image(48);
    let file = image.file("vm.mem").unwrap().0;
    let imgfmt::StoredAt::Pack { pack, offset, .. } = image.files[file].chunks[5].at else { panic!("chunk 5 is stored") };
    let blob = std::fs::OpenOptions::new().read(true).write(true).open(layout.blob_path(&image.packs[pack as usize].digest)).unwrap();
    let mut b = [0u8; 1];
    blob.read_exact_at(&mut b, offset + 10).unwrap();
    blob.write_all_at(&[b[0] ^ 0x01], offset + 10).unwrap();
    let Some(guest) = Guest::new(&[(mem.len(), 0)]) else { return };
    let data: Vec<usize> = (0..48).filter(|c| c % 3 != 1).collect();
    let data_bytes = stored(&image, data.iter().copied());
    let tampered_bytes = stored(&image, [5]);
    let src = Gauge::new(layout, Duration::from_millis(20));
    let run = start(dir.path(), image, src.clone(), |o| o.prefetch = PrefetchMode::All, None);
    let sock = guest.connect(&run.socket);
    // 31 good data chunks; chunk 5 is read twice (its run, then alone) and refused
    // (counted once its fetch is over).
    wait_for("the stream", || streamed(&run.daemon) == data.len() as u64 - 1 && metric(&run.daemon, "snapctl_lazy_verify_failures_total") == 2);
    assert_eq!(src.bytes.load(Ordering::SeqCst), data_bytes + tampered_bytes, "each chunk read once, the tampered one twice");
    assert!(src.reads.load(Ordering::SeqCst) < data.len() as u64, "runs: fewer requests than chunks");
    let (p, _, _) = guest.regions[0];
    let present = resident(p, mem.len());
    for &c in &data {
        let pages = &present[c * 16..(c + 1) * 16];
        if c == 5 {
            assert!(pages.iter().all(|&r| !r), "the tampered chunk was installed");
        } else {
            assert!(pages.iter().all(|&r| r), "chunk {c} not installed by the stream");
        }
    }
    // The tampered chunk, touched: poisoned (EFAULT through process_vm_readv), never wrong.
    let mut buf = vec![0u8; 4096];
    let local = libc::iovec { iov_base: buf.as_mut_ptr() as *mut libc::c_void, iov_len: 4096 };
    // SAFETY: inside the live guest mapping.
    let remote = libc::iovec { iov_base: unsafe { p.add(5 * K64) } as *mut libc::c_void, iov_len: 4096 };
    // SAFETY: both iovecs describe live memory of this process.
    let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
    assert_eq!(n, -1, "a chunk that fails verification must not be readable");
    for &c in &data {
        if c != 5 {
            assert!(guest.region(0)[c * K64..(c + 1) * K64] == mem[c * K64..(c + 1) * K64], "chunk {c}");
        }
    }
    drop(sock);
    let rep = run.reports.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(rep.streamed_chunks, data.len() as u64 - 1, "{rep:?}");
    assert_eq!(rep.streamed_bytes, (data.len() as u64 - 1) * K64 as u64, "{rep:?}");
    assert!(rep.stream_started_s.is_some_and(|s| s < 1.0), "{rep:?}");
    assert!(rep.stream_depth >= 1 && rep.stream_rtt_ms.is_some(), "{rep:?}");
    // Two refusals by the stream, two by the fault; the fault's span poisoned.
    assert_eq!(rep.verify_failures, 4, "{rep:?}");
    assert_eq!(rep.poisoned_pages, (K64 / 4096) as u64, "{rep:?}");
    assert_eq!((rep.faults.fetched, rep.faults.cache_hit), (0, 0), "every good chunk was streamed before the guest touched it: {rep:?}");
}

/// Issue 16 §3: the stream fills its window (at most --stream-jobs chunks' bytes, in at
/// most --stream-jobs requests) while no fault waits, and reads each chunk once.
#[test]
fn regression_issue_16_stream_keeps_its_depth_in_flight() {
    let (dir, mem, image, layout) = sample_image(96);
    let Some(guest) = Guest::new(&[(mem.len(), 0)]) else { return };
    let data_bytes = stored(&image, 0..96);
    // 50 ms per request: a 10 Gbit/s link would hold hundreds of 64 KiB chunks; the
    // bound is --stream-jobs 8.
    let src = Gauge::new(layout, Duration::from_millis(50));
    let run = start(
        dir.path(),
        image,
        src.clone(),
        |o| {
            o.prefetch = PrefetchMode::All;
            o.stream_jobs = 8;
        },
        None,
    );
    let sock = guest.connect(&run.socket);
    let data = (0..96).filter(|c| c % 3 != 1).count() as u64;
    wait_for("the stream", || streamed(&run.daemon) == data);
    let most = src.most.load(Ordering::SeqCst);
    assert!((1..=8).contains(&most), "{most} requests in flight at once");
    assert_eq!(src.bytes.load(Ordering::SeqCst), data_bytes, "each chunk once");
    drop(sock);
    let rep = run.reports.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(rep.streamed_chunks, data, "{rep:?}");
    assert!((1..=8).contains(&rep.stream_depth), "{rep:?}");
    // A worker for each request that found every worker busy: never more than were in flight.
    assert!((1..=rep.stream_depth).contains(&rep.stream_threads), "{rep:?}");
    // The window's bound is 8 chunks' bytes; the stream's bytes in flight reach it, or all
    // of the image's stored bytes when they are fewer (the sample's chunks compress well).
    assert!(rep.pacing.most_bytes >= data_bytes.min(4 * K64 as u64), "{rep:?}");
    assert!(rep.pacing.most_window <= 8 * K64 as u64, "{rep:?}");
    assert!(rep.stream_rtt_ms.is_some_and(|ms| ms >= 50.0), "{rep:?}");
}

/// Issue 16 §3: faults come first. While the stream works through the image in file order,
/// the guest touches the last data chunk: its fault does not wait for the stream to get
/// there (nor behind its queue), and the stream does not stop for the waiting fault (it
/// did: the prefetcher paused while any fault waited).
#[test]
fn regression_issue_16_faults_are_served_while_the_stream_runs() {
    let (dir, mem, image, layout) = sample_image(96);
    let file = image.file("vm.mem").unwrap().0;
    let imgfmt::StoredAt::Pack { offset, .. } = image.files[file].chunks[95].at else { panic!("chunk 95 is stored") };
    let Some(guest) = Guest::new(&[(mem.len(), 0)]) else { return };
    let mut g = Gauge::new(layout, Duration::from_millis(50));
    // The fault's own fetch takes 600 ms: the stream goes on meanwhile.
    Arc::get_mut(&mut g).unwrap().slow = Some((offset, Duration::from_millis(600)));
    let src = g;
    let run = start(
        dir.path(),
        image,
        src.clone(),
        |o| {
            o.prefetch = PrefetchMode::All;
            o.stream_jobs = 2;
        },
        None,
    );
    let sock = guest.connect(&run.socket);
    let data = (0..96).filter(|c| c % 3 != 1).count() as u64;
    // 64 chunks at most 2 at a time, 50 ms each: the stream needs 1.6 s or more.
    wait_for("the stream to start", || streamed(&run.daemon) > 0);
    let last = 95 * K64;
    let before = streamed(&run.daemon);
    let t = Instant::now();
    assert!(guest.region(0)[last..last + K64] == mem[last..last + K64]);
    let waited = t.elapsed();
    let by_then = streamed(&run.daemon);
    assert!(by_then < data - 1, "the fault waited for the stream to reach its chunk ({by_then} of {data} streamed, {waited:?})");
    assert!(by_then >= before + 4, "the stream stopped while the fault waited {waited:?}: {before} streamed before, {by_then} after");
    wait_for("the rest of the stream", || streamed(&run.daemon) == data - 1);
    drop(sock);
    let rep = run.reports.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(rep.faults.fetched, 1, "{rep:?}");
    assert_eq!(src.reads.load(Ordering::SeqCst), data, "the stream skipped what the fault fetched");
}

/// Issue 16 §3: with --prefetch trace and no trace, the rest of the image is streamed once
/// faults have waited for --stream-after of the data chunks, not before.
#[test]
fn regression_issue_16_scattered_misses_start_the_stream() {
    let (dir, mem, image, layout) = sample_image(96);
    let Some(guest) = Guest::new(&[(mem.len(), 0)]) else { return };
    // Each read takes a millisecond, and the stream has one request in flight: it gets to
    // the chunk of the miss that started it (the last in file order) well after that
    // miss's own fetch brought it, so that chunk is the fault's, never the stream's.
    let src = Gauge::new(layout, Duration::from_millis(1));
    let run = start(
        dir.path(),
        image,
        src.clone(),
        |o| {
            o.prefetch = PrefetchMode::Trace;
            o.stream_after = Some(0.25);
            o.stream_jobs = 1;
        },
        None,
    );
    let sock = guest.connect(&run.socket);
    // 64 data chunks: the 16th distinct miss starts the stream.
    let data: Vec<usize> = (0..96).filter(|c| c % 3 != 1).collect();
    let r = guest.region(0);
    for &c in data.iter().take(15) {
        assert_eq!(r[c * K64 + 4096 * 3], mem[c * K64 + 4096 * 3]);
    }
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(streamed(&run.daemon), 0, "15 misses of 64: no stream yet");
    let c = data[data.len() - 1];
    assert_eq!(r[c * K64], mem[c * K64]);
    wait_for("the stream", || streamed(&run.daemon) == data.len() as u64 - 16);
    assert!(r == &mem[..]);
    drop(sock);
    let rep = run.reports.recv_timeout(Duration::from_secs(10)).unwrap();
    assert!(rep.stream_started_s.is_some(), "{rep:?}");
    // 16 of 64 data chunks missed is over NEEDS_MOST_AFTER: the pacing was widened.
    assert!(rep.pacing.widened, "{rep:?}");
    assert_eq!((rep.faults.fetched, rep.streamed_chunks), (16, data.len() as u64 - 16), "{rep:?}");
    assert_eq!(src.reads.load(Ordering::SeqCst), data.len() as u64);
    assert_eq!((rep.stream_depth, rep.stream_threads), (1, 1), "--stream-jobs 1: {rep:?}");
}

/// A guest whose misses never start the stream costs no stream threads: they start with
/// the stream's requests, not with the connection (at wake, 32 thread starts beside the
/// first fault took the cores of a small host).
#[test]
fn regression_issue_23_a_stream_that_never_starts_starts_no_threads() {
    let (dir, mem, image, layout) = sample_image(96);
    let Some(guest) = Guest::new(&[(mem.len(), 0)]) else { return };
    let run = start(dir.path(), image, Gauge::new(layout, Duration::ZERO), |o| o.prefetch = PrefetchMode::Trace, None);
    let sock = guest.connect(&run.socket);
    // Three misses of 64 data chunks: under the default --stream-after.
    let r = guest.region(0);
    for c in [0usize, 2, 3] {
        assert_eq!(r[c * K64 + 4096], mem[c * K64 + 4096]);
    }
    drop(sock);
    let rep = run.reports.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(rep.stream_started_s, None, "{rep:?}");
    assert_eq!((rep.streamed_chunks, rep.stream_depth, rep.stream_threads), (0, 0, 0), "{rep:?}");
    assert_eq!(rep.faults.fetched, 3, "{rep:?}");
}

/// Like `sample_image`, but every 4 KiB page of a data chunk is different (its page number
/// leads it), so a page installed at the wrong place reads wrong; loaded with outboards.
fn distinct_image(chunks: usize) -> (tempfile::TempDir, Vec<u8>, Arc<Image>) {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    let mut mem = vec![0u8; chunks * K64];
    for (p, page) in mem.chunks_mut(4096).enumerate() {
        if (p * 4096 / K64) % 3 != 1 {
            for (j, b) in page.iter_mut().enumerate() {
                *b = (j as u8).wrapping_mul(13).wrapping_add(p as u8) | 1;
            }
            page[..8].copy_from_slice(&(p as u64).to_le_bytes());
        }
    }
    std::fs::write(src.join("vm.mem"), &mem).unwrap();
    std::fs::write(src.join("vm.state"), b"state").unwrap();
    let layout = imgfmt::OciLayout::open_or_create(dir.path().join("layout")).unwrap();
    let opts = pusher::PackOptions { chunk_shift: 16, kind: Some(imgfmt::Kind::Firecracker), ..Default::default() };
    pusher::pack(&src, &layout, "t", &opts).unwrap();
    let mut image = Image::open(&layout, &layout.resolve_tag("t").unwrap()).unwrap();
    image.load_outboards(&layout).unwrap();
    (dir, mem, Arc::new(image))
}

/// Traces kept in the sample's layout (under the fallback tag).
fn layout_traces(dir: &std::path::Path) -> Option<Box<dyn TraceStore>> {
    Some(Box::new(LayoutTraces(imgfmt::OciLayout::open(dir.join("layout")).unwrap())))
}

/// A source over the sample's layout whose every read takes `delay`, as across a network.
fn slow(layout: imgfmt::OciLayout, delay: Duration) -> Arc<Flaky> {
    Arc::new(Flaky { delay, ..Arc::try_unwrap(flaky(layout)).ok().unwrap() })
}

/// Whether page `p` of the 64 KiB-chunk samples holds data (chunks `c % 3 == 1` are zero).
fn data_page(p: usize) -> bool {
    (p * 4096 / K64) % 3 != 1
}

/// Record a working set: a restore with --record-trace whose guest reads `pages` (page
/// numbers of the file), in that order; returns the stored trace. With `slices`, first
/// misses are served by slice (the default), else every page from its whole chunk.
fn record_working_set(dir: &std::path::Path, mem: &[u8], image: &Arc<Image>, pages: &[usize], slices: bool) -> Trace {
    let traces = || layout_traces(dir);
    let guest = Guest::new(&[(mem.len(), 0)]).expect("userfaultfd");
    let src = flaky(imgfmt::OciLayout::open(dir.join("layout")).unwrap());
    let run = start(
        dir,
        image.clone(),
        src.clone(),
        |o| {
            o.record_trace = true;
            o.prefetch = PrefetchMode::None;
            o.slice_faults = slices;
        },
        traces(),
    );
    let sock = guest.connect(&run.socket);
    for &p in pages {
        assert_eq!(guest.region(0)[p * 4096..(p + 1) * 4096], mem[p * 4096..(p + 1) * 4096], "page {p}");
    }
    drop(sock);
    let rep = run.reports.recv_timeout(Duration::from_secs(10)).unwrap();
    let data: Vec<usize> = pages.iter().copied().filter(|&p| data_page(p)).collect();
    assert_eq!(rep.working_set_recorded, data.len() as u64, "{rep:?}");
    if !slices {
        // Each data chunk was fetched once; every page of it the guest read faulted once.
        let chunks: std::collections::HashSet<usize> = data.iter().map(|p| p * 4096 / K64).collect();
        assert_eq!(src.reads.load(Ordering::SeqCst), chunks.len() as u64);
        assert_eq!(rep.faults.fetched + rep.faults.cache_hit, data.len() as u64, "{rep:?}");
    }
    traces().unwrap().load(image, image.file("vm.mem").unwrap().0).unwrap().expect("a trace")
}

/// Pages the working-set tests touch: scattered over the data chunks of a 24-chunk sample,
/// three per chunk, in an order that is neither file order nor chunk by chunk, plus a page
/// of a zero chunk (never recorded).
fn scattered_pages() -> Vec<usize> {
    let mut v: Vec<usize> = Vec::new();
    for k in [13usize, 2, 7] {
        for c in [9usize, 0, 20, 5, 17, 3] {
            v.push(c * 16 + k);
        }
    }
    v.push(16 + 4); // chunk 1: zero
    v
}

/// Issue 16 §3 (REAP's working set): a recording restore stores, beside the trace, the
/// slices whose pages the guest touched, in first-touch order; the next restore fetches
/// them in bulk at connect, checks each against the outboard and installs it before the
/// guest asks, and fetches nothing else for those pages. Pages next to them stay missing.
#[test]
fn regression_issue_16_working_set_is_recorded_by_slice_and_replayed_before_the_guest_asks() {
    let (dir, mem, image) = distinct_image(24);
    if Guest::new(&[(4096, 0)]).is_none() {
        return;
    }
    let pages = scattered_pages();
    let t = record_working_set(dir.path(), &mem, &image, &pages, true);
    let data: Vec<u64> = pages.iter().filter(|&&p| data_page(p)).map(|&p| (p * 4096) as u64).collect();
    assert_eq!(t.working_set, data, "slices in first-touch order, zero pages left out");
    assert_eq!(t.zero_chunks, vec![1], "the zero chunk touched is listed apart");
    let blob = t.working_set_blob.clone().expect("a working-set blob");
    assert_eq!(blob.size, data.len() as u64 * 4096);

    let guest = Guest::new(&[(mem.len(), 0)]).unwrap();
    let src = flaky(imgfmt::OciLayout::open(dir.path().join("layout")).unwrap());
    let run = start(dir.path(), image.clone(), src.clone(), |o| o.stream_after = None, layout_traces(dir.path()));
    let sock = guest.connect(&run.socket);
    let (p0, _, _) = guest.regions[0];
    // The zero chunks are installed beside the ranges, by the same replay: both, before
    // anything is looked at.
    wait_for("the working set installed", || {
        metric(&run.daemon, "snapctl_lazy_working_set_slices_total") == data.len() as u64 && resident(p0, mem.len())[16..32].iter().all(|&x| x)
    });
    let present = resident(p0, mem.len());
    for &p in &pages {
        assert!(present[p], "page {p} installed before the guest touched it");
        if data_page(p) {
            assert!(!present[p + 1] || pages.contains(&(p + 1)), "page {} beside it was not", p + 1);
        }
    }
    assert!(present[16..32].iter().all(|&x| x), "the touched zero chunk is installed whole (zeros, nothing fetched)");
    assert!(!present[4 * 16], "an untouched zero chunk is not");
    assert_eq!(src.reads.load(Ordering::SeqCst), 1, "one range of the blob, no chunk");
    for &p in &pages {
        assert_eq!(guest.region(0)[p * 4096..(p + 1) * 4096], mem[p * 4096..(p + 1) * 4096], "page {p}");
    }
    // A page the working set did not hold is still served, whole chunk, verified.
    let other = 9 * 16 + 4;
    assert_eq!(guest.region(0)[other * 4096..(other + 1) * 4096], mem[other * 4096..(other + 1) * 4096]);
    drop(sock);
    let rep = run.reports.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(rep.working_set_slices, data.len() as u64, "{rep:?}");
    assert_eq!(rep.working_set_bytes, data.len() as u64 * 4096, "{rep:?}");
    assert_eq!(rep.faults.total, 1, "only the page outside the working set faulted: {rep:?}");
    assert!(rep.working_set_s.is_some(), "{rep:?}");
    assert_eq!((rep.verify_failures, rep.poisoned_pages), (0, 0));
}

/// Issue 16 §3: the working-set blob is not trusted. A slice whose bytes were changed in
/// the stored blob fails its check against the outboard and is not installed; the guest's
/// fault there fetches the chunk, verified, and reads the snapshot's bytes. Faults that
/// come while the blob is still on its way wait for it instead of fetching.
#[test]
fn regression_issue_16_tampered_working_set_slice_is_never_installed() {
    use std::os::unix::fs::FileExt;
    let (dir, mem, image) = distinct_image(24);
    if Guest::new(&[(4096, 0)]).is_none() {
        return;
    }
    let pages = scattered_pages();
    let t = record_working_set(dir.path(), &mem, &image, &pages, false);
    let blob = t.working_set_blob.clone().unwrap();
    // Flip a byte of the 4th slice in the blob (page `pages[3]`).
    let layout = imgfmt::OciLayout::open(dir.path().join("layout")).unwrap();
    let f = std::fs::OpenOptions::new().read(true).write(true).open(layout.blob_path(&blob.digest)).unwrap();
    let at = 3 * 4096 + 99;
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at).unwrap();
    f.write_all_at(&[b[0] ^ 0x40], at).unwrap();

    let guest = Guest::new(&[(mem.len(), 0)]).unwrap();
    // Every read takes 150 ms: the guest's first touches come while the blob is in flight.
    let src = slow(layout, Duration::from_millis(150));
    let run = start(dir.path(), image.clone(), src.clone(), |o| o.stream_after = None, layout_traces(dir.path()));
    let sock = guest.connect(&run.socket);
    for &p in &pages {
        assert_eq!(guest.region(0)[p * 4096..(p + 1) * 4096], mem[p * 4096..(p + 1) * 4096], "page {p}");
    }
    drop(sock);
    let rep = run.reports.recv_timeout(Duration::from_secs(10)).unwrap();
    let data = pages.iter().filter(|&&p| data_page(p)).count() as u64;
    // A slice of the blob that fails its check is a hint refused, not the image failing
    // verification (issue 21): counted apart, and the guest got only verified bytes.
    assert_eq!((rep.working_set_rejected_slices, rep.verify_failures), (1, 0), "{rep:?}");
    assert!(!rep.integrity_failed(), "{rep:?}");
    assert_eq!(rep.working_set_slices, data - 1, "{rep:?}");
    assert!(rep.bytes_fetched > 0, "the tampered slice's page was fetched on its own: {rep:?}");
    assert!(rep.working_set_waits >= 1, "the first touch waited for the blob: {rep:?}");
    assert_eq!(rep.poisoned_pages, 0);
}

/// Whether a connection of `d` has a working-set replay coming or running.
fn replay_expected(d: &Daemon) -> bool {
    d.conns.lock().unwrap().iter().filter_map(|w| w.upgrade()).any(|c| c.ws.expected())
}

/// Issue 37: while a working set is replayed or on its way, a fault outside it is served by
/// its slice alone, not with its whole chunk beside it (those chunks were megabytes on the
/// link ahead of the working set at wake); once the replay is over, a fault's whole chunk
/// comes beside its slice again.
#[test]
fn regression_issue_37_a_fault_during_a_replay_fetches_its_slice_without_its_chunk() {
    let (dir, mem, image) = distinct_image(24);
    if Guest::new(&[(4096, 0)]).is_none() {
        return;
    }
    let pages = scattered_pages();
    record_working_set(dir.path(), &mem, &image, &pages, true);
    let data = pages.iter().filter(|&&p| data_page(p)).count() as u64;
    let guest = Guest::new(&[(mem.len(), 0)]).unwrap();
    let (p0, _, _) = guest.regions[0];
    // Every read takes 150 ms: the guest's first touch comes while the blob is in flight.
    let src = slow(imgfmt::OciLayout::open(dir.path().join("layout")).unwrap(), Duration::from_millis(150));
    let run = start(dir.path(), image.clone(), src.clone(), |o| o.stream_after = None, layout_traces(dir.path()));
    let sock = guest.connect(&run.socket);
    // Chunks 11 and 14 hold data and no page of the working set.
    let (during, after) = (11 * 16 + 1, 14 * 16 + 1);
    assert!(data_page(during) && data_page(after) && !pages.iter().any(|p| [11, 14].contains(&(p / 16))));
    // The connection's replay is on its way (the blob's first read takes 150 ms).
    wait_for("the connection's replay coming", || replay_expected(&run.daemon));
    assert_eq!(guest.region(0)[during * 4096..(during + 1) * 4096], mem[during * 4096..(during + 1) * 4096]);
    wait_for("the working set installed", || metric(&run.daemon, "snapctl_lazy_working_set_slices_total") == data);
    wait_for("the replay over", || !replay_expected(&run.daemon));
    assert_eq!(guest.region(0)[after * 4096..(after + 1) * 4096], mem[after * 4096..(after + 1) * 4096]);
    wait_for("the whole chunk beside the fault after the replay", || resident(p0, mem.len())[after + 1]);
    let present = resident(p0, mem.len());
    assert!(!present[during + 1], "no whole chunk was fetched beside the fault during the replay");
    for p in [during + 1, after + 1] {
        assert_eq!(guest.region(0)[p * 4096..(p + 1) * 4096], mem[p * 4096..(p + 1) * 4096], "page {p}");
    }
    drop(sock);
    let rep = run.reports.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!(rep.working_set_slices, data, "{rep:?}");
    assert_eq!((rep.verify_failures, rep.poisoned_pages), (0, 0));
}

/// The worked example of spec/lazy.md "Prefetch and traces": the trace JSON and the
/// working-set blob a recording restore stores for a guest touching pages 157, 13, 333 (data)
/// and 20 (zero chunk 1) of the 64 KiB-chunk sample, byte for byte.
#[test]
fn working_set_trace_matches_the_spec_worked_example() {
    let (dir, mem, image) = distinct_image(24);
    if Guest::new(&[(4096, 0)]).is_none() {
        return;
    }
    let t = record_working_set(dir.path(), &mem, &image, &[157, 13, 333, 20], false);
    let json = serde_json::to_string(&t).unwrap();
    assert_eq!(
        json,
        r#"{"format":"snapctl.trace.v1","file":"vm.mem","chunkSize":65536,"chunks":[9,0,20],"workingSet":[643072,53248,1363968],"zeroChunks":[1]}"#
    );
    let blob = t.working_set_blob.expect("a blob");
    let layout = imgfmt::OciLayout::open(dir.path().join("layout")).unwrap();
    let bytes = std::fs::read(layout.blob_path(&blob.digest)).unwrap();
    assert_eq!(bytes.len(), 12288);
    assert_eq!(bytes[..4096], mem[0x9d000..0x9e000]);
    assert_eq!(bytes[4096..8192], mem[0xd000..0xe000]);
    assert_eq!(bytes[8192..], mem[0x14d000..0x14e000]);
}

/// Issue 16: a trace's zero chunks are installed as zeros only where the image's record is
/// the digest of zeros (the fault path's own test). A zero record carrying another digest
/// (a lying index) gets no zeros ahead of the guest: the guest's touch is poisoned, as a
/// fault there always was.
#[test]
fn regression_issue_16_replayed_zero_chunks_need_a_true_zero_record() {
    let (dir, mem, image) = distinct_image(24);
    if Guest::new(&[(4096, 0)]).is_none() {
        return;
    }
    let pages = [157, 20, 13];
    let t = record_working_set(dir.path(), &mem, &image, &pages, false);
    assert_eq!(t.zero_chunks, vec![1]);
    // The same image, but zero chunk 1's record now carries a data chunk's digest.
    let Ok(mut lying) = Arc::try_unwrap(image) else { panic!("the image is shared") };
    let file = lying.file("vm.mem").unwrap().0;
    lying.files[file].chunks[1].digest = lying.files[file].chunks[0].digest;
    let guest = Guest::new(&[(mem.len(), 0)]).unwrap();
    let src = flaky(imgfmt::OciLayout::open(dir.path().join("layout")).unwrap());
    let run = start(dir.path(), Arc::new(lying), src, |o| o.stream_after = None, layout_traces(dir.path()));
    let sock = guest.connect(&run.socket);
    wait_for("the working set installed", || metric(&run.daemon, "snapctl_lazy_working_set_slices_total") == 2);
    let (p0, _, _) = guest.regions[0];
    let present = resident(p0, mem.len());
    assert!(present[157] && present[13], "the data slices were replayed");
    assert!(!present[16..32].iter().any(|&x| x), "no zeros installed for a zero record that is not zero");
    // Through process_vm_readv a poisoned page is EFAULT, not a SIGBUS.
    let mut buf = vec![0u8; 4096];
    let local = libc::iovec { iov_base: buf.as_mut_ptr() as *mut libc::c_void, iov_len: 4096 };
    // SAFETY: inside the live guest mapping.
    let remote = libc::iovec { iov_base: unsafe { p0.add(20 * 4096) } as *mut libc::c_void, iov_len: 4096 };
    // SAFETY: both iovecs describe live memory of this process.
    let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
    assert_eq!(n, -1, "the lying zero chunk is poisoned when touched");
    drop(sock);
    let rep = run.reports.recv_timeout(Duration::from_secs(10)).unwrap();
    assert!(rep.poisoned_pages > 0, "{rep:?}");
}

/// A bottleneck in front of the sample's layout, queueing as `snapctl_tests::netem`'s link
/// does: a request takes half the round trip to the server; its response (a 200-byte
/// header and the bytes asked for) goes in pieces of 1 ms of link time, each booked onto
/// one link of `rate` bytes per second shared by every request after the pieces booked
/// before it, the next piece booked when this one starts to leave (so responses in flight
/// take turns, a piece each); it arrives half a round trip after its last byte left.
/// `queue`: a shallow buffer of that much link time: a piece that finds more booked ahead
/// of it is dropped and sent again a round trip later; `None`: a deep buffer.
struct Bottleneck {
    inner: imgfmt::OciLayout,
    rtt: Duration,
    secs_per_byte: f64,
    piece: usize,
    queue: Option<Duration>,
    free_at: Mutex<Instant>,
    drops: AtomicU64,
}

impl Bottleneck {
    fn new(inner: imgfmt::OciLayout, rtt: Duration, bytes_per_sec: f64, queue: Option<Duration>) -> Arc<Bottleneck> {
        Arc::new(Bottleneck {
            inner,
            rtt,
            secs_per_byte: 1.0 / bytes_per_sec,
            piece: ((bytes_per_sec / 1000.0) as usize).max(1024),
            queue,
            free_at: Mutex::new(Instant::now()),
            drops: 0.into(),
        })
    }

    /// Move a response of `n` bytes; return once it has arrived.
    fn transfer(&self, n: usize) {
        let sleep_until = |t: Instant| {
            let now = Instant::now();
            if t > now {
                std::thread::sleep(t - now);
            }
        };
        sleep_until(Instant::now() + self.rtt / 2);
        let mut left = n + 200;
        let mut last = Instant::now();
        while left > 0 {
            let k = left.min(self.piece);
            let len = Duration::from_secs_f64(k as f64 * self.secs_per_byte);
            let booked = {
                let now = Instant::now();
                let mut free = self.free_at.lock().unwrap();
                let start = (*free).max(now);
                let queued = start - now;
                if self.queue.is_some_and(|q| !queued.is_zero() && queued + len > q) {
                    None
                } else {
                    *free = start + len;
                    Some((start, *free))
                }
            };
            match booked {
                Some((start, end)) => {
                    sleep_until(start);
                    last = end;
                    left -= k;
                }
                None => {
                    self.drops.fetch_add(1, Ordering::SeqCst);
                    std::thread::sleep(self.rtt);
                }
            }
        }
        sleep_until(last + self.rtt / 2);
    }
}

impl imgfmt::source::Forward for Bottleneck {
    fn inner(&self) -> &dyn imgfmt::BlobSource {
        &self.inner
    }
    fn describe(&self) -> String {
        "bottleneck".into()
    }
    fn blob_size(&self, d: &imgfmt::OciDigest) -> Result<u64, imgfmt::FormatError> {
        self.transfer(0);
        self.inner.blob_size(d)
    }
    fn read_at_unverified(&self, d: &imgfmt::OciDigest, o: u64, buf: &mut [u8]) -> Result<(), imgfmt::FormatError> {
        self.transfer(buf.len());
        self.inner.read_at_unverified(d, o, buf)
    }
}

/// Median of `v` (sorted in place).
fn median(v: &mut [Duration]) -> Duration {
    v.sort_unstable();
    v[v.len() / 2]
}

/// Issue 23 §2: the stream is a scavenger. Across a slow bottleneck (8 MB/s, RTT 20 ms; a
/// 64 KiB chunk is 8 ms of link, the image's 320 data chunks 2.6 s; [`Bottleneck`]), one
/// vCPU touches one page in each of 20 data chunks before the stream starts (the detector
/// lets it go at the 21st miss), then, while the stream works through the image, 20 more,
/// from the end of the file where the stream does not get in time. Of the touches that
/// found their page missing, the median with the stream running is at most half the round
/// trip over the same run's median without it (the goal, a quarter, is the benchmark's), a touch of a second
/// page of the same chunk (it waits for the whole chunk) at most three round trips over,
/// and the stream still moves meanwhile. Unpaced, the stream kept up to `--stream-jobs`
/// (32) requests in flight: a fault's slice waited behind a piece of each (about +30 ms
/// here), its chunk shared the link with all of them (about +250 ms).
fn stream_yields_to_faults_at_the_bottleneck(queue: Option<Duration>) {
    let (dir, mem, image, layout) = sample_image(960);
    let image = with_outboards(image, &layout);
    let Some(guest) = Guest::new(&[(mem.len(), 0)]) else { return };
    let link = Bottleneck::new(imgfmt::OciLayout::open(dir.path().join("layout")).unwrap(), Duration::from_millis(20), 8e6, queue);
    drop(layout);
    let data: Vec<usize> = (0..960).filter(|c| c % 3 != 1).collect();
    let run = start(
        dir.path(),
        image,
        link.clone(),
        |o| {
            o.prefetch = PrefetchMode::Trace;
            // The 21st distinct miss lets the stream go.
            o.stream_after = Some(20.5 / data.len() as f64);
        },
        None,
    );
    let sock = guest.connect(&run.socket);
    let (r, (p0, _, _)) = (guest.region(0), guest.regions[0]);
    let mut touch = data.iter().rev().map(|&c| c * K64 + 7 * 4096);
    // Time the touches that fault (their page not installed just before), and the touch of
    // a second page of the same chunk right after (it waits for the whole chunk).
    let timed = |n: usize, touch: &mut dyn Iterator<Item = usize>| -> (Vec<Duration>, Vec<Duration>) {
        let (mut first, mut whole) = (Vec::new(), Vec::new());
        for at in touch.take(n) {
            // SAFETY: `at` is inside the live guest mapping.
            let missing = !resident(unsafe { p0.add(at) }, 4096)[0];
            let t = Instant::now();
            assert_eq!(r[at], mem[at]);
            let f = t.elapsed();
            assert_eq!(r[at + 5 * 4096], mem[at + 5 * 4096]);
            if missing {
                first.push(f);
                whole.push(t.elapsed());
            }
        }
        (first, whole)
    };
    let (mut before, mut before_whole) = timed(20, &mut touch);
    assert_eq!(streamed(&run.daemon), 0, "no stream yet");
    // The 21st miss starts the stream; let it open its window.
    let _ = timed(1, &mut touch);
    wait_for("the stream", || streamed(&run.daemon) >= 4);
    std::thread::sleep(Duration::from_millis(200));
    let streamed_before = streamed(&run.daemon);
    let (mut during, mut during_whole) = timed(20, &mut touch);
    let streamed_during = streamed(&run.daemon) - streamed_before;
    assert!(before.len() >= 15 && during.len() >= 15, "the touches found their pages missing: {} and {}", before.len(), during.len());
    let (b, d) = (median(&mut before), median(&mut during));
    let (bw, dw) = (median(&mut before_whole), median(&mut during_whole));
    // Printed for whoever looks at a run (cargo test -- --nocapture).
    eprintln!(
        "first touch: median {b:?} without the stream, {d:?} with it; whole chunk {bw:?}, {dw:?}; {streamed_during} chunks streamed meanwhile; {} drops",
        link.drops.load(Ordering::SeqCst)
    );
    assert!(streamed_during >= 10, "the stream starved: {streamed_during} chunks while the faults ran");
    drop(sock);
    let rep = run.reports.recv_timeout(Duration::from_secs(10)).unwrap();
    assert!(rep.pacing.probes > 0 && rep.pacing.base_ms.is_some(), "{rep:?}");
    assert_eq!((rep.verify_failures, rep.poisoned_pages), (0, 0));
    let (rtt, drops) = (link.rtt, link.drops.load(Ordering::SeqCst));
    // The goal is a quarter of the round trip (measured in bench/wan.sh); the bound here is
    // half of it, so a loaded CI machine's jitter (about 1-5 ms in a median of 20) does not
    // fail it, while an unpaced stream (+27 ms behind the deep buffer) still does.
    assert!(d <= b + rtt / 2, "faults waited behind the stream: median {d:?} with it, {b:?} without ({drops} drops at the buffer)");
    assert!(dw <= bw + 3 * rtt, "the faults' chunks waited behind the stream: median {dw:?} with it, {bw:?} without ({drops} drops at the buffer)");
}

#[test]
fn regression_issue_23_stream_yields_to_faults_at_a_deep_bottleneck() {
    stream_yields_to_faults_at_the_bottleneck(None);
}

/// The same behind a shallow buffer (6 ms of link, 30% of the bandwidth-delay product): a
/// piece that finds it full is dropped and comes a round trip later. The buffer bounds the
/// queue, so an unpaced stream adds little to a slice (about +5 ms here) but fills the
/// buffer: the faults' chunks lose pieces and wait round trips (about +200 ms).
#[test]
fn regression_issue_23_stream_yields_to_faults_at_a_shallow_bottleneck() {
    stream_yields_to_faults_at_the_bottleneck(Some(Duration::from_millis(6)));
}

/// Issue 21 §9: the metrics listener served one connection at a time, each read with a 2 s
/// timeout, so a client sending a byte every 1.5 s held every scrape. Each connection is
/// served on its own (at most `MAX_METRICS_CONNECTIONS`) with `METRICS_DEADLINE` for the
/// whole exchange: the scrape is answered at once, the dripping client cut off.
#[test]
fn regression_issue_21_a_dripping_metrics_client_does_not_block_a_scrape() {
    use std::io::{Read, Write};
    let (dir, _mem, image, layout) = sample_image(6);
    let run = start(dir.path(), image, flaky(layout), |o| o.prefetch = PrefetchMode::None, None);
    let addr = run.daemon.serve_metrics("127.0.0.1:0").unwrap();
    let scrape = || -> std::io::Result<String> {
        let mut s = std::net::TcpStream::connect(addr)?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")?;
        let mut text = String::new();
        s.read_to_string(&mut text)?;
        Ok(text)
    };
    // A client that sends its request a byte every 1.5 s.
    let slow = std::net::TcpStream::connect(addr).unwrap();
    let (tx, rx) = mpsc::channel::<()>();
    let dripper = {
        let mut w = slow.try_clone().unwrap();
        std::thread::spawn(move || {
            for b in b"GET /metrics HTTP/1.1\r\n\r\n" {
                if w.write_all(&[*b]).is_err() || rx.recv_timeout(Duration::from_millis(1500)).is_ok() {
                    return;
                }
            }
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    let t = Instant::now();
    let text = scrape();
    let took = t.elapsed();
    assert!(
        text.as_ref().is_ok_and(|t| t.starts_with("HTTP/1.1 200") && t.contains("snapctl_lazy_connections")),
        "a scrape beside a dripping client: {text:?} after {took:?}"
    );
    // The dripping client is cut off at the deadline, unanswered.
    let mut s = slow;
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got);
    assert!(got.is_empty(), "the dripping client got an answer: {}", String::from_utf8_lossy(&got));
    let _ = tx.send(());
    dripper.join().unwrap();
    // Slow clients fill the slots, not the listener: with every slot held, another
    // connection is closed unanswered at once; once they are cut off, scrapes work again.
    // (A host so busy that the slots' deadlines passed before the look tells nothing: look
    // again.)
    let mut looked = false;
    for _ in 0..5 {
        let t0 = Instant::now();
        let held: Vec<std::net::TcpStream> = (0..MAX_METRICS_CONNECTIONS).map(|_| std::net::TcpStream::connect(addr).unwrap()).collect();
        // The listener takes the held connections in its own time (late on a busy host): a
        // scrape answered meanwhile found a slot free; look again until one is refused.
        let mut refused = scrape();
        while refused.as_ref().is_ok_and(|t| !t.is_empty()) && t0.elapsed() < METRICS_DEADLINE / 4 {
            std::thread::sleep(Duration::from_millis(50));
            refused = scrape();
        }
        let took = t0.elapsed();
        std::thread::sleep(METRICS_DEADLINE + Duration::from_millis(500));
        assert!(scrape().is_ok_and(|t| t.starts_with("HTTP/1.1 200")), "the slots are free again");
        drop(held);
        if took >= METRICS_DEADLINE / 2 {
            continue;
        }
        assert!(refused.as_ref().map_or(true, |t| t.is_empty()), "a ninth connection is closed unanswered: {refused:?}");
        looked = true;
        break;
    }
    assert!(looked, "the host was too busy to look five times over");
}

mod fill;

/// A front end over OCI layouts only, as a test or a tool without the CLI would write one.
struct LayoutFront;

impl wake::Front for LayoutFront {
    type Error = LazyError;
    fn layout(&self, path: &std::path::Path) -> Result<imgfmt::OciLayout, LazyError> {
        imgfmt::OciLayout::open(path).map_err(|e| LazyError::Invalid(e.to_string()))
    }
    fn registry(&self, host: &str, _: &str) -> Result<regclient::RegistrySource, LazyError> {
        Err(LazyError::Invalid(format!("{host}: no registries here")))
    }
    fn resolve(&self, source: &Arc<dyn imgfmt::BlobSource>, selector: &imgfmt::reference::Selector) -> Result<imgfmt::OciDigest, LazyError> {
        match selector {
            imgfmt::reference::Selector::Tag(t) => source.resolve_tag(t).map_err(|e| LazyError::Invalid(e.to_string())),
            imgfmt::reference::Selector::Digest(d) => Ok(d.clone()),
        }
    }
    fn open(&self, at: &wake::Opening<'_>) -> Result<(Image, Option<imgfmt::PendingOutboards>), LazyError> {
        let src = at.store.metadata();
        let opened = match at.outboards {
            None => Image::open(src.as_ref(), at.digest).map(|i| (i, None)),
            Some(ahead) => Image::open_outboards_later(src, at.digest, ahead).map(|(i, p)| (i, Some(p))),
        };
        opened.map_err(|e| LazyError::Invalid(e.to_string()))
    }
    fn memory_file(&self, image: &Image) -> Result<usize, LazyError> {
        image.file("vm.mem").map(|f| f.0).ok_or_else(|| LazyError::Invalid("no vm.mem".into()))
    }
}

/// Prepare the sample's layout image through [`LayoutFront`] and serve it on a socket in
/// `dir`, as `snapctl lazy oci:DIR/layout:t` does.
fn prepare_and_serve(dir: &std::path::Path, opts: impl FnOnce(&mut LazyOptions)) -> (Running, bool) {
    let socket = dir.join(format!("uffd-{}.sock", rand::random::<u32>()));
    let mut o = LazyOptions::new(socket.clone());
    o.ready_file = Some(dir.join("ready"));
    let _ = std::fs::remove_file(dir.join("ready"));
    opts(&mut o);
    let reference: imgfmt::reference::Reference = format!("oci:{}:t", dir.join("layout").display()).parse().unwrap();
    let prepared = wake::prepare(&LayoutFront, &reference, o, false).unwrap();
    let file = prepared.image.file("vm.mem").unwrap().0;
    let woken = prepared.serve(file, None).unwrap();
    let (daemon, coming) = (woken.daemon.clone(), woken.replay_coming);
    let (tx, rx) = mpsc::channel();
    let tx = Mutex::new(tx);
    let d = daemon.clone();
    let thread = std::thread::spawn(move || {
        let _woken = woken;
        d.run(Arc::new(move |r: &ConnReport| tx.lock().unwrap().send(r.clone()).unwrap()))
    });
    wait_for("the daemon ready", || dir.join("ready").exists());
    (Running { daemon, socket, reports: rx, thread: Some(thread) }, coming)
}

#[test]
fn a_prepared_image_is_served_by_a_front_end_that_is_not_the_cli() {
    let (dir, mem, _, _) = sample_image(24);
    let Some(guest) = Guest::new(&[(mem.len(), 0)]) else { return };
    let (run, coming) = prepare_and_serve(dir.path(), |o| o.prefetch = PrefetchMode::None);
    assert!(!coming, "no trace to read");
    let sock = guest.connect(&run.socket);
    assert!(guest.region(0) == &mem[..], "every page as the snapshot holds it");
    drop(sock);
    let rep = run.reports.recv_timeout(Duration::from_secs(10)).expect("a report");
    assert_eq!((rep.verify_failures, rep.poisoned_pages), (0, 0));
    assert!(rep.slice_fetches > 0, "first misses served by slice: the outboards' tables were read before the socket: {rep:?}");
}

#[test]
fn a_prepared_image_with_a_recorded_working_set_listens_first_and_replays_it() {
    let (dir, mem, image) = distinct_image(24);
    if Guest::new(&[(4096, 0)]).is_none() {
        return;
    }
    let pages = scattered_pages();
    let t = record_working_set(dir.path(), &mem, &image, &pages, true);
    let data = pages.iter().filter(|&&p| data_page(p)).count() as u64;
    assert_eq!(t.working_set.len() as u64, data);

    let guest = Guest::new(&[(mem.len(), 0)]).unwrap();
    let (run, coming) = prepare_and_serve(dir.path(), |o| o.stream_after = None);
    assert!(coming, "the trace is read once the socket is bound");
    let sock = guest.connect(&run.socket);
    wait_for("the working set installed", || metric(&run.daemon, "snapctl_lazy_working_set_slices_total") == data);
    for &p in &pages {
        assert_eq!(guest.region(0)[p * 4096..(p + 1) * 4096], mem[p * 4096..(p + 1) * 4096], "page {p}");
    }
    drop(sock);
    let rep = run.reports.recv_timeout(Duration::from_secs(10)).expect("a report");
    assert_eq!(rep.working_set_slices, data, "{rep:?}");
    assert!(rep.working_set_s.is_some() && rep.trace_digest.is_some(), "{rep:?}");
    assert_eq!((rep.verify_failures, rep.poisoned_pages), (0, 0));
}
