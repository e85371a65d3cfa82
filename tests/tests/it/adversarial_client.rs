//! The client against hostile peers (issue 14): a registry that hands its uploads and
//! downloads to another origin, a second local user at the lazy socket, an image built to
//! exhaust memory. Each test names what the component promises (`spec/transfer.md`,
//! `spec/lazy.md`, `spec/format.md`) and fails when the promise is broken.

use std::time::{Duration, Instant};

use snapctl_tests::fault_proxy::{Fault, FaultProxy, Match, Rule};
use snapctl_tests::registry_support::{htpasswd, Serve};
use snapctl_tests::{run, Work};

/// Steps of these tests beside [`Work`]'s own.
trait ClientWork {
    /// A small sample snapshot packed into a layout; its `oci:` reference.
    fn packed(&self) -> String;
}

impl ClientWork for Work {
    fn packed(&self) -> String {
        let snap = self.path("snap");
        self.ok(&["sample", snap.to_str().unwrap(), "--size", "4MiB"]);
        let lay = self.path("layout");
        let r = format!("oci:{}:v1", lay.display());
        self.ok(&["pack", snap.to_str().unwrap(), &r]);
        r
    }
}

/// What the other origin saw carry an `Authorization` header.
fn credentials_seen(p: &FaultProxy) -> Vec<String> {
    p.log().iter().filter(|s| s.authorization.is_some()).map(|s| format!("{} {}: {}", s.method, s.target, s.authorization.as_deref().unwrap_or(""))).collect()
}

/// spec/transfer.md §1: credentials go only to the registry's origin. A registry that
/// wants Basic credentials answers the upload POST with a `Location` on another origin
/// (here a second listener, another port): the PATCH/PUT there carry no credentials,
/// and the push still completes (that server takes uploads without them).
#[test]
fn regression_issue_14_push_sends_no_basic_credentials_to_another_origin() {
    let store = tempfile::tempdir().unwrap();
    let upstream = Serve::start(store.path().to_str().unwrap(), &[], &[]);
    let registry = FaultProxy::start(upstream.addr.as_str()).unwrap();
    registry.require_basic("alice", "s3cret");
    let elsewhere = FaultProxy::start(upstream.addr.as_str()).unwrap();
    registry.add(Rule::new(Fault::MoveLocation { to: elsewhere.origin() }).on(Match::new("POST", "/blobs/uploads/")).times(u64::MAX));
    let w = Work::new();
    w.credentials(&registry.addr, "alice", "s3cret");
    let src = w.packed();
    let dest = format!("{}/adv/basic:v1", registry.addr);
    w.ok(&["push", &src, &dest]);
    assert!(elsewhere.log().iter().any(|s| s.method == "PUT"), "the uploads went to the other origin: {:?}", elsewhere.log());
    assert_eq!(credentials_seen(&elsewhere), Vec::<String>::new(), "credentials sent to another origin");
    assert!(registry.log().iter().any(|s| s.authorization.is_some()), "the registry itself got its credentials");
    w.ok(&["verify", &dest]);
}

/// The same with a token registry (`snapctl serve --htpasswd`: the Bearer flow). The
/// token belongs to the registry's origin too: the upload server gets none, refuses the
/// upload, and the push fails (exit 2) rather than hand the token on.
#[test]
fn regression_issue_14_push_sends_no_token_to_another_origin() {
    let store = tempfile::tempdir().unwrap();
    let pw = tempfile::tempdir().unwrap();
    htpasswd(&pw.path().join("htpasswd"), &[("alice", "s3cret")]);
    let upstream = Serve::start(store.path().to_str().unwrap(), &["--htpasswd", pw.path().join("htpasswd").to_str().unwrap()], &[]);
    let registry = FaultProxy::start(upstream.addr.as_str()).unwrap();
    let elsewhere = FaultProxy::start(upstream.addr.as_str()).unwrap();
    registry.add(Rule::new(Fault::MoveLocation { to: elsewhere.origin() }).on(Match::new("POST", "/blobs/uploads/")).times(u64::MAX));
    let w = Work::new();
    w.credentials(&registry.addr, "alice", "s3cret");
    let src = w.packed();
    let r = run(w.cmd().args(["push", &src, &format!("{}/adv/token:v1", registry.addr)]));
    assert!(!elsewhere.log().is_empty(), "the client was sent to the other origin: {r:?}");
    assert_eq!(credentials_seen(&elsewhere), Vec::<String>::new(), "token sent to another origin");
    assert!(registry.log().iter().any(|s| s.authorization.as_deref().is_some_and(|a| a.starts_with("Bearer "))), "the registry got its token");
    assert_eq!(r.code, 2, "the upload server wants credentials it must not get: {r:?}");
}

/// Issue 22: `inspect` of a registry image opened the repository twice, the image with
/// one client and the listing of what is attached to it with another: a second
/// connection and login, a round trip more to a remote registry. With one client the
/// registry challenges for credentials once, and the referrers are still listed.
#[test]
fn regression_issue_22_inspect_opens_its_source_once() {
    let store = tempfile::tempdir().unwrap();
    let upstream = Serve::start(store.path().to_str().unwrap(), &[], &[]);
    let registry = FaultProxy::start(upstream.addr.as_str()).unwrap();
    registry.require_basic("alice", "s3cret");
    let w = Work::new();
    w.credentials(&registry.addr, "alice", "s3cret");
    let src = w.packed();
    let dest = format!("{}/adv/inspect:v1", registry.addr);
    w.ok(&["push", &src, &dest]);
    let before = registry.log().len();
    let out = w.ok(&["inspect", &dest, "--json"]);
    let seen: Vec<_> = registry.log()[before..].to_vec();
    let summary: Vec<String> = seen.iter().map(|s| format!("{} {} {}", s.status, s.method, s.target)).collect();
    assert!(seen.iter().any(|s| s.target.contains("/referrers/") && s.status == 200), "the referrers were listed: {summary:#?}");
    assert_eq!(seen.iter().filter(|s| s.status == 401).count(), 1, "one client, one challenge: {summary:#?}");
    assert!(out.stdout.contains("\"referrers\""), "{out:?}");
}

/// Redirected range reads (a registry sending blob GETs to a CDN) carry no credentials
/// either, and a pull through them still verifies every chunk.
#[test]
fn regression_issue_14_redirected_reads_carry_no_credentials() {
    let store = tempfile::tempdir().unwrap();
    let upstream = Serve::start(store.path().to_str().unwrap(), &[], &[]);
    let registry = FaultProxy::start(upstream.addr.as_str()).unwrap();
    registry.require_basic("alice", "s3cret");
    let cdn = FaultProxy::start(upstream.addr.as_str()).unwrap();
    let w = Work::new();
    w.credentials(&registry.addr, "alice", "s3cret");
    let src = w.packed();
    let dest = format!("{}/adv/redirect:v1", registry.addr);
    w.ok(&["push", &src, &dest]);
    registry.add(Rule::new(Fault::Redirect { code: 307, to: cdn.origin() }).on(Match::blob_gets()).times(u64::MAX));
    let out = w.path("out");
    w.ok(&["pull", &dest, out.to_str().unwrap(), "--cache", w.path("pull-cache").to_str().unwrap()]);
    assert!(cdn.log().iter().any(|s| s.method == "GET" && s.status == 206), "range reads went to the CDN: {:?}", cdn.log());
    assert_eq!(credentials_seen(&cdn), Vec::<String>::new(), "credentials sent to another origin");
    w.ok(&["verify", &dest, "--against", out.to_str().unwrap()]);
}

/// `snapctl lazy REF --socket SOCKET EXTRA...` started with umask 000 (as the issue found
/// it: the socket was then 0777), waited for until it listens.
fn lazy_under_umask_000(w: &Work, reference: &str, socket: &std::path::Path, extra: &[&str]) -> crate::lazy::Handler {
    use std::os::unix::process::CommandExt;
    let mut cmd = w.cmd();
    cmd.args(["lazy", reference, "--json", "--no-cache", "--prefetch", "none", "--socket"]).arg(socket).args(extra);
    // SAFETY: umask(2) only sets the child's file mode mask; it allocates nothing and
    // cannot fail, so it is safe between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            libc::umask(0);
            Ok(())
        })
    };
    crate::lazy::Handler::spawn(cmd, socket)
}

/// What happened to a connection made as another user.
#[derive(Debug, PartialEq, Eq)]
enum Peer {
    /// connect(2) failed (the socket's mode kept the user out).
    CouldNotConnect,
    /// The daemon hung up (refused) after the handshake was sent.
    HungUp,
    /// The daemon kept the connection (it took the handshake) for 3 s.
    KeptOpen,
}

/// Connect to `socket` as `uid`/`gid` and send a Firecracker handshake: one region of one
/// page, and a descriptor (a pipe's: the daemon reads the handshake before it ever uses
/// the descriptor as a userfaultfd) by SCM_RIGHTS. A forked child does it with raw system
/// calls only (everything is prepared before the fork: the test binary has threads).
fn connect_as(uid: u32, gid: u32, socket: &std::path::Path) -> Peer {
    use std::os::unix::ffi::OsStrExt;
    let body = br#"[{"base_host_virt_addr":268435456,"size":4096,"offset":0,"page_size":4096,"page_size_kib":4096}]"#;
    // SAFETY: zeroed plain-old-data structures, filled in below.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let p = socket.as_os_str().as_bytes();
    assert!(p.len() < addr.sun_path.len(), "socket path too long for sockaddr_un");
    for (d, s) in addr.sun_path.iter_mut().zip(p) {
        *d = *s as libc::c_char;
    }
    let mut pipe = [0i32; 2];
    // SAFETY: pipe(2) writes two descriptors into the array we own.
    assert_eq!(unsafe { libc::pipe(pipe.as_mut_ptr()) }, 0);
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<i32>() as u32) } as usize;
    let mut control = vec![0u8; space];
    let mut iov = libc::iovec { iov_base: body.as_ptr() as *mut libc::c_void, iov_len: body.len() };
    // SAFETY: zeroed msghdr, then pointed at buffers that outlive the fork below; the
    // CMSG_* macros only compute offsets inside `control`, which is CMSG_SPACE(int) long.
    let msg = unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr() as *mut libc::c_void;
        msg.msg_controllen = space;
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<i32>() as u32) as usize;
        std::ptr::write_unaligned(libc::CMSG_DATA(c) as *mut i32, pipe[0]);
        msg
    };
    // SAFETY: the child calls only async-signal-safe system calls on memory prepared
    // above, then _exit: nothing of the (multi-threaded) parent's state is touched.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        // SAFETY: see above; every call is a plain system call on owned memory.
        unsafe {
            if libc::setgroups(0, std::ptr::null()) != 0 || libc::setgid(gid) != 0 || libc::setuid(uid) != 0 {
                libc::_exit(20);
            }
            let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
            if fd < 0 {
                libc::_exit(21);
            }
            if libc::connect(fd, &addr as *const libc::sockaddr_un as *const libc::sockaddr, std::mem::size_of::<libc::sockaddr_un>() as u32) != 0 {
                libc::_exit(10);
            }
            if libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL) < 0 {
                // The daemon may refuse and close before the handshake is sent (it accepts
                // at once): a hang-up, as much as a close after it.
                let e = *libc::__errno_location();
                libc::_exit(if e == libc::EPIPE || e == libc::ECONNRESET { 0 } else { 11 });
            }
            libc::alarm(3);
            let mut b = [0u8; 1];
            let n = libc::read(fd, b.as_mut_ptr() as *mut libc::c_void, 1);
            libc::_exit(if n <= 0 { 0 } else { 12 });
        }
    }
    // SAFETY: closing the pipe we created, and waiting for our own child.
    let status = unsafe {
        libc::close(pipe[0]);
        libc::close(pipe[1]);
        let mut status = 0;
        assert_eq!(libc::waitpid(pid, &mut status, 0), pid);
        status
    };
    if libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGALRM {
        return Peer::KeptOpen;
    }
    match libc::WEXITSTATUS(status) {
        0 => Peer::HungUp,
        10 => Peer::CouldNotConnect,
        other => panic!("the peer failed on its own: exit {other}"),
    }
}

fn is_root() -> bool {
    // SAFETY: geteuid takes nothing and cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    if !root {
        assert!(!snapctl_tests::require_peers(), "this test must run as root (SNAPCTL_REQUIRE_PEERS=1)");
        eprintln!("SKIP: needs root (to act as a second user)");
    }
    root
}

/// spec/lazy.md: the socket is the daemon's user's alone. Started with umask 000, the
/// socket is still 0600 (it was 0777: any local user could connect), and no private
/// directory used to create it is left behind.
#[test]
fn regression_issue_14_lazy_socket_is_0600_under_umask_000() {
    use std::os::unix::fs::PermissionsExt;
    let w = Work::new();
    let reference = w.packed();
    let socket = w.path("vm.sock");
    let h = lazy_under_umask_000(&w, &reference, &socket, &[]);
    let mode = std::fs::symlink_metadata(&socket).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode, 0o600, "socket mode {mode:o}: {}", h.log_text());
    let left: Vec<_> = std::fs::read_dir(w.root()).unwrap().flatten().map(|e| e.file_name()).filter(|n| n.to_string_lossy().starts_with(".snapctl")).collect();
    assert!(left.is_empty(), "private directories left: {left:?}");
}

/// spec/lazy.md: another local user (nobody, 65534) cannot have the daemon copy the
/// snapshot's memory into a userfaultfd of theirs. With umask 000 the socket used to let
/// them connect and the daemon took their handshake; now the mode keeps them out, and
/// where the mode would not (the socket made 0666, a bind mount), the daemon checks the
/// peer's credentials, logs the refusal and hangs up without reading the descriptor.
/// `--allow-uid 65534` lets them in: the option a jailed VMM needs.
#[test]
fn regression_issue_14_lazy_refuses_another_users_process() {
    use std::os::unix::fs::PermissionsExt;
    if !is_root() {
        return;
    }
    let w = Work::new();
    // nobody must reach the socket's directory (temp dirs are 0700).
    std::fs::set_permissions(w.root(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let reference = w.packed();
    let socket = w.path("vm.sock");
    let h = lazy_under_umask_000(&w, &reference, &socket, &[]);
    let served = |h: &crate::lazy::Handler| h.log_text().contains("region(s)");
    let peer = connect_as(65534, 65534, &socket);
    assert_ne!(peer, Peer::KeptOpen, "{}", h.log_text());
    assert!(!served(&h), "another user's handshake was taken: {}", h.log_text());

    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    assert_eq!(connect_as(65534, 65534, &socket), Peer::HungUp, "{}", h.log_text());
    let log = h.log_text();
    assert!(log.contains("refusing a connection from uid 65534 gid 65534"), "the refusal is logged: {log}");
    assert!(!served(&h), "another user's handshake was taken: {log}");
    drop(h);

    let socket = w.path("allowed.sock");
    let h = lazy_under_umask_000(&w, &reference, &socket, &["--allow-uid", "65534"]);
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    let _ = connect_as(65534, 65534, &socket);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !served(&h) && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(served(&h), "--allow-uid 65534 admits nobody: {}", h.log_text());
}

/// Peak RSS of `snapctl lazy` over `reference`: started, waited for until it listens, then
/// stopped with SIGTERM (it has no guest to serve; what it holds is the opened image).
fn lazy_peak_rss(w: &Work, reference: &str) -> (i32, u64) {
    let socket = w.path("lazy.sock");
    let out = w.path("lazy.peak");
    let mut helper = std::process::Command::new(env!("CARGO_BIN_EXE_peak_rss"));
    helper.arg(&out).arg(snapctl_tests::snapctl_bin()).args(["lazy", reference, "--socket"]).arg(&socket).args(["--no-cache", "--prefetch", "none"]);
    helper.env("SNAPCTL_CACHE", w.path("cache")).stdout(std::process::Stdio::null()).stderr(std::process::Stdio::piped());
    let mut child = helper.spawn().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(600);
    while !socket.exists() {
        if let Ok(Some(st)) = child.try_wait() {
            panic!("snapctl lazy ended before listening: {st}");
        }
        assert!(std::time::Instant::now() < deadline, "snapctl lazy did not listen within 600 s");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    // The helper's one child is snapctl.
    let kids = std::fs::read_to_string(format!("/proc/{}/task/{}/children", child.id(), child.id())).unwrap();
    let pid: i32 = kids.split_whitespace().next().expect("snapctl runs").parse().unwrap();
    // SAFETY: kill(2) on the pid of our helper's child; no memory involved.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let st = child.wait().unwrap();
    (st.code().unwrap_or(-1), std::fs::read_to_string(&out).unwrap().trim().parse().unwrap())
}

/// Peak RSS of `snapctl verify`, `pull` (into a directory, sparse) and `lazy` over
/// `reference`.
fn peaks(w: &Work, reference: &str) -> [(&'static str, i32, u64); 3] {
    let peak = env!("CARGO_BIN_EXE_peak_rss").as_ref();
    let (vc, vp) = snapctl_tests::hostile::run_peak_rss(peak, w.cmd().args(["verify", reference]));
    let dest = w.path("pulled");
    let _ = std::fs::remove_dir_all(&dest);
    let (pc, pp) = snapctl_tests::hostile::run_peak_rss(peak, w.cmd().args(["pull", reference]).arg(&dest).args(["--no-cache"]));
    let _ = std::fs::remove_dir_all(&dest);
    let (lc, lp) = lazy_peak_rss(w, reference);
    [("verify", vc, vp), ("pull", pc, pp), ("lazy", lc, lp)]
}

/// The figures of issue 14 §14: peak RSS of verify, pull and lazy over the largest
/// index the format allows (4.19 M records, a 4 TiB file), as one image and as a chain of
/// four such layers, of zero chunks (consistent) and of corrupt stored chunks. Minutes of
/// work and ~2.5 GB of disk, so not in the default run:
/// `cargo test -- --ignored measure_memory_of_the_largest_indexes --nocapture` (set
/// `SNAPCTL_BIN` to compare another build; `SNAPCTL_HUGE_RECORDS` for fewer records).
#[test]
#[ignore = "a measurement (minutes, ~2.5 GB of disk), not a check"]
fn measure_memory_of_the_largest_indexes() {
    use snapctl_tests::hostile::{huge_index_image, Chunks, MAX_RECORDS};
    let records = std::env::var("SNAPCTL_HUGE_RECORDS").ok().and_then(|v| v.parse().ok()).unwrap_or(MAX_RECORDS);
    let w = Work::new();
    for (kind, layers) in [(Chunks::Zero, 1usize), (Chunks::Zero, 4), (Chunks::CorruptStored, 1), (Chunks::CorruptStored, 4)] {
        let lay = w.path(&format!("huge-{kind:?}-{layers}"));
        let img = huge_index_image(&lay, "v1", records, layers, kind);
        let reference = format!("oci:{}:v1", lay.display());
        for (what, code, peak) in peaks(&w, &reference) {
            println!(
                "{kind:?}, {layers} layer(s), {:.0} MiB of index: {what:6} exit {code}, peak RSS {:.0} MiB ({:.2} x the index bytes)",
                img.index_bytes as f64 / (1 << 20) as f64,
                peak as f64 / (1 << 20) as f64,
                peak as f64 / img.index_bytes as f64
            );
        }
        let _ = std::fs::remove_dir_all(&lay);
    }
}

/// What a client may hold for an image, beyond its buffers: a small multiple of the bytes
/// of its index blobs (spec/format.md §12 states the parts; measured at most 3.8x).
const MEMORY_PER_INDEX_BYTE: u64 = 4;
/// The process itself, its threads and fixed buffers (a `verify` of a tiny image peaks
/// near 20 MiB in a debug build).
const MEMORY_SLACK: u64 = 64 << 20;

fn assert_bounded(what: &str, (code, peak): (i32, u64), want_code: i32, index_bytes: u64) {
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    assert_eq!(code, want_code, "{what}: exit {code}");
    let bound = MEMORY_PER_INDEX_BYTE * index_bytes + MEMORY_SLACK;
    assert!(
        peak <= bound,
        "{what}: peak RSS {:.0} MiB over {:.0} MiB ({MEMORY_PER_INDEX_BYTE} x {:.0} MiB of index + {:.0} MiB)",
        mib(peak),
        mib(bound),
        mib(index_bytes),
        mib(MEMORY_SLACK)
    );
    eprintln!("{what}: peak RSS {:.0} MiB, {:.2} x the index", mib(peak), peak as f64 / index_bytes as f64);
}

/// spec/format.md §12: a hostile image cannot make verify, pull or lazy hold more than a
/// small multiple of its index bytes (lazy held about 2.4x before and is checked too). A consistent image of 1 Mi zero chunks (64 MiB of
/// index, a 1 TiB sparse file) made verify hold 8.3x its index (the resolved table copied,
/// Merkle trees built whole); one of 1 Mi distinct stored chunks that all fail made
/// verify hold 15x (a work map with a name per chunk, a failure per chunk) and pull 5.5x
/// (a vector and a hash map entry per chunk). Peak RSS comes from `wait4` of the command
/// alone (the `peak_rss` helper): a memory bound, not a timing.
#[test]
fn regression_issue_14_client_memory_is_bounded_by_the_index_size() {
    use snapctl_tests::hostile::{huge_index_image, run_peak_rss, Chunks};
    let peak = env!("CARGO_BIN_EXE_peak_rss").as_ref();
    let w = Work::new();
    let zero = w.path("zero");
    let img = huge_index_image(&zero, "v1", 1 << 20, 1, Chunks::Zero);
    let r = format!("oci:{}:v1", zero.display());
    assert_bounded("verify (zero chunks)", run_peak_rss(peak, w.cmd().args(["verify", &r])), 0, img.index_bytes);
    let out = w.path("out");
    assert_bounded("pull (zero chunks)", run_peak_rss(peak, w.cmd().args(["pull", &r]).arg(&out).arg("--no-cache")), 0, img.index_bytes);
    std::fs::remove_dir_all(&out).unwrap();
    std::fs::remove_dir_all(&zero).unwrap();

    let corrupt = w.path("corrupt");
    let img = huge_index_image(&corrupt, "v1", 1 << 20, 1, Chunks::CorruptStored);
    let r = format!("oci:{}:v1", corrupt.display());
    assert_bounded("verify (corrupt stored chunks)", run_peak_rss(peak, w.cmd().args(["verify", &r])), 1, img.index_bytes);
    assert_bounded("pull (corrupt stored chunks)", run_peak_rss(peak, w.cmd().args(["pull", &r]).arg(&out).arg("--no-cache")), 1, img.index_bytes);
    assert!(!out.join("vm.mem").exists(), "nothing unverified under the final name");
    // lazy holds the opened image (and, per connection, a chunk order).
    assert_bounded("lazy (corrupt stored chunks)", lazy_peak_rss(&w, &r), 0, img.index_bytes);
}

/// Issue 21 §7: a registry dripping its answers at one byte per second was never a
/// failure: the client's timeout applied per read, and every read moved a byte, so
/// `pull` never ended. A whole request now has a deadline (here 3 s) and retrying is
/// bounded in wall-clock time (here 6 s): the pull fails, and says why.
#[test]
fn regression_issue_21_a_dripping_registry_fails_a_pull_within_the_deadline() {
    let store = tempfile::tempdir().unwrap();
    let upstream = Serve::start(store.path().to_str().unwrap(), &[], &[]);
    let registry = FaultProxy::start(upstream.addr.as_str()).unwrap();
    let w = Work::new();
    let src = w.packed();
    let dest = format!("{}/adv/drip:v1", registry.addr);
    w.ok(&["push", &src, &dest]);
    registry.add(Rule::new(Fault::Drip { every: Duration::from_secs(1) }).on(Match::blob_gets()).times(u64::MAX));
    let out = w.path("out");
    let mut cmd = w.cmd();
    cmd.env("SNAPCTL_REQUEST_TIMEOUT", "3s").env("SNAPCTL_RETRY_BUDGET", "6s");
    cmd.args(["pull", &dest, out.to_str().unwrap(), "--cache", w.path("pull-cache").to_str().unwrap()]);
    cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
    let t = Instant::now();
    let mut child = cmd.spawn().unwrap();
    // Before the deadline this pull never ended: give it 90 s, then kill it and fail.
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break Some(st);
        }
        if t.elapsed() > Duration::from_secs(90) {
            let _ = child.kill();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let took = t.elapsed();
    eprintln!("pull through a dripping registry ended after {took:?} with {status:?}: {stderr}");
    assert!(status.is_some(), "pull still running after {took:?} through a registry dripping one byte per second");
    assert_eq!(status.unwrap().code(), Some(2), "{stderr}");
    assert!(stderr.contains("request deadline"), "the error does not say what ran out: {stderr}");
    // Two budgets at most (the client's, then the pull's range retry) and one deadline.
    assert!(took < Duration::from_secs(40), "took {took:?}");
}
