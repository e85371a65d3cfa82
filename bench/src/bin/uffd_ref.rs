//! `uffd_ref`: the reference page-fault handler `snapctl lazy` is measured against.
//!
//! It speaks the same Firecracker UFFD handshake (one message: JSON region mappings + the
//! userfaultfd as SCM_RIGHTS) and serves every fault straight from a local memory file with
//! UFFDIO_COPY: no registry, no cache, no digests, no decompression. That is the floor a
//! verifying lazy server can approach, not something to run in production: a production
//! handler must check what it installs (this one trusts the file), must not let one slow
//! source block every fault, and must survive its source going away.
//!
//! Granularity: by default a fault installs the whole 1 MiB block around it (clipped to the
//! region), the same unit `snapctl lazy` installs (one chunk of the default chunk size), so
//! the comparison is like for like; `--granularity 4096` serves single pages instead.
//! Zero blocks are copied like any other (the daemon's UFFDIO_ZEROPAGE is its own advantage).
//! Ranges the guest removed (UFFD_EVENT_REMOVE) are served as zeros afterwards.
//!
//! ```text
//! uffd_ref --socket PATH --mem-file FILE [--granularity BYTES] [--once] [--json]
//! ```

use std::collections::VecDeque;
use std::fs::File;
use std::io::{IoSliceMut, Read};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, ensure, Context};
use nix::sys::socket::{getsockopt, recvmsg, sockopt::PeerCredentials, ControlMessageOwned, MsgFlags};
use userfaultfd::{Error as UffdError, Event, Uffd};

const PAGE: u64 = 4096;

struct Args {
    socket: PathBuf,
    mem_file: PathBuf,
    granularity: u64,
    once: bool,
    json: bool,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut socket = None;
    let mut mem_file = None;
    let mut granularity = 1u64 << 20;
    let mut once = false;
    let mut json = false;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut val = |name: &str| it.next().with_context(|| format!("{name} needs a value"));
        match a.as_str() {
            "--socket" => socket = Some(PathBuf::from(val("--socket")?)),
            "--mem-file" => mem_file = Some(PathBuf::from(val("--mem-file")?)),
            "--granularity" => granularity = val("--granularity")?.parse().context("--granularity: bytes")?,
            "--once" => once = true,
            "--json" => json = true,
            "-h" | "--help" => {
                println!("uffd_ref --socket PATH --mem-file FILE [--granularity BYTES] [--once] [--json]");
                std::process::exit(0);
            }
            other => bail!("unknown argument {other:?}"),
        }
    }
    ensure!(granularity >= PAGE && granularity.is_power_of_two(), "--granularity must be a power of two >= 4096");
    Ok(Args { socket: socket.context("--socket is required")?, mem_file: mem_file.context("--mem-file is required")?, granularity, once, json })
}

/// One entry of Firecracker's mapping message.
#[derive(Debug, Clone, Copy)]
struct Region {
    base: u64,
    size: u64,
    offset: u64,
}

/// The memory file, mapped read-only once and shared by every connection.
struct Source {
    addr: u64,
    len: u64,
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("uffd_ref: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn run() -> anyhow::Result<()> {
    let a = parse_args()?;
    let f = File::open(&a.mem_file).with_context(|| format!("open {}", a.mem_file.display()))?;
    let len = f.metadata()?.len();
    ensure!(len > 0 && len % PAGE == 0, "{}: size {len} is not a positive multiple of 4096", a.mem_file.display());
    // SAFETY: a read-only private mapping of a file we opened; it is only ever read, as the
    // source of UFFDIO_COPY, and stays mapped until the process exits.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len as usize, libc::PROT_READ, libc::MAP_PRIVATE, f.as_raw_fd(), 0) };
    ensure!(p != libc::MAP_FAILED, "mmap {}: {}", a.mem_file.display(), std::io::Error::last_os_error());
    let src = Source { addr: p as u64, len };

    let _ = std::fs::remove_file(&a.socket);
    let listener = UnixListener::bind(&a.socket).with_context(|| format!("bind {}", a.socket.display()))?;
    eprintln!("uffd_ref: listening on {}", a.socket.display());
    let src = std::sync::Arc::new(src);
    for conn in listener.incoming() {
        let conn = conn.context("accept")?;
        let src = src.clone();
        let (granularity, json) = (a.granularity, a.json);
        // One thread per VM: connections never wait for each other.
        let h = std::thread::spawn(move || {
            if let Err(e) = serve(conn, &src, granularity, json) {
                eprintln!("uffd_ref: connection: {e:#}");
            }
        });
        if a.once {
            let _ = h.join();
            break;
        }
    }
    Ok(())
}

/// Receive the mappings and the userfaultfd sent in one message.
fn handshake(conn: &UnixStream) -> anyhow::Result<(Vec<Region>, Uffd)> {
    let mut buf = vec![0u8; 64 << 10];
    let mut cmsg = nix::cmsg_space!([RawFd; 1]);
    let mut iov = [IoSliceMut::new(&mut buf)];
    let msg = recvmsg::<()>(conn.as_raw_fd(), &mut iov, Some(&mut cmsg), MsgFlags::MSG_CMSG_CLOEXEC).context("recvmsg")?;
    let n = msg.bytes;
    let mut fd = None;
    for c in msg.cmsgs().context("control messages")? {
        if let ControlMessageOwned::ScmRights(fds) = c {
            for f in fds {
                if fd.is_none() {
                    fd = Some(f);
                } else {
                    // SAFETY: an fd we were just handed and do not use.
                    unsafe { libc::close(f) };
                }
            }
        }
    }
    let fd = fd.context("no userfaultfd in the message")?;
    // SAFETY: the fd came to us by SCM_RIGHTS and nothing else owns it.
    let uffd = unsafe { Uffd::from_raw_fd(fd) };
    let v: serde_json::Value = serde_json::from_slice(&buf[..n]).context("mapping JSON")?;
    let arr = v.as_array().context("mapping JSON is not an array")?;
    let mut regions = Vec::new();
    for m in arr {
        let get = |k: &str| m.get(k).and_then(|x| x.as_u64()).with_context(|| format!("mapping without {k}"));
        regions.push(Region { base: get("base_host_virt_addr")?, size: get("size")?, offset: get("offset")? });
    }
    Ok((regions, uffd))
}

struct Conn<'a> {
    uffd: Uffd,
    regions: Vec<Region>,
    src: &'a Source,
    granularity: u64,
    /// Guest address ranges removed by the guest, [start, end): served as zeros from now on.
    removed: Vec<(u64, u64)>,
    pending: VecDeque<u64>,
    /// The peer's address space is gone (ESRCH): stop serving.
    gone: bool,
    faults: u64,
    bytes_copied: u64,
}

impl Conn<'_> {
    /// Read every queued event: removals are recorded, faults queued.
    fn drain(&mut self) -> anyhow::Result<()> {
        while let Some(ev) = self.uffd.read_event().context("read uffd event")? {
            match ev {
                Event::Pagefault { addr, .. } => self.pending.push_back(addr as u64),
                Event::Remove { start, end } => self.removed.push((start as u64, end as u64)),
                other => eprintln!("uffd_ref: ignoring event {other:?}"),
            }
        }
        Ok(())
    }

    fn is_removed(&self, a: u64, len: u64) -> bool {
        self.removed.iter().any(|&(s, e)| a < e && s < a + len)
    }

    fn serve_fault(&mut self, addr: u64) -> anyhow::Result<()> {
        self.faults += 1;
        let page = addr & !(PAGE - 1);
        let Some(r) = self.regions.iter().copied().find(|r| page >= r.base && page < r.base + r.size) else {
            bail!("fault at {addr:#x} outside every region");
        };
        let fo = r.offset + (page - r.base);
        let start = (fo / self.granularity * self.granularity).max(r.offset);
        let end = (start - start % self.granularity + self.granularity).min(r.offset + r.size);
        let dst = r.base + (start - r.offset);
        let len = end - start;
        if self.is_removed(dst, len) {
            // Page by page: removed pages become zeros, the rest snapshot data.
            for p in (0..len).step_by(PAGE as usize) {
                self.install(dst + p, start + p, PAGE)?;
            }
        } else {
            self.install(dst, start, len)?;
        }
        // If every page was already present, nobody was woken: wake the faulting thread.
        let _ = self.uffd.wake(page as *mut libc::c_void, PAGE as usize);
        Ok(())
    }

    /// Install [dst, dst+len) from file offset `fo`, tolerating pages already present
    /// (EEXIST) and retrying after pending remove events (EAGAIN).
    fn install(&mut self, dst: u64, fo: u64, len: u64) -> anyhow::Result<()> {
        let mut done = 0u64;
        while done < len {
            let (d, o, n) = (dst + done, fo + done, len - done);
            if self.is_removed(d, PAGE) || o >= self.src.len {
                // The userfaultfd crate has its own nix version: errnos are compared as numbers.
                // SAFETY: d..d+PAGE lies in a region the peer registered with this uffd.
                match unsafe { self.uffd.zeropage(d as *mut libc::c_void, PAGE as usize, true) } {
                    Ok(_) => done += PAGE,
                    Err(UffdError::ZeropageFailed(e)) if e as i32 == libc::EEXIST => done += PAGE,
                    Err(UffdError::ZeropageFailed(e)) if e as i32 == libc::EAGAIN => self.drain()?,
                    Err(UffdError::ZeropageFailed(e)) if e as i32 == libc::ESRCH => {
                        self.gone = true;
                        return Ok(());
                    }
                    Err(e) => bail!("UFFDIO_ZEROPAGE at {d:#x}: {e:?}"),
                }
                continue;
            }
            let n = n.min(self.src.len - o);
            // SAFETY: the source is our read-only mapping of the file (o+n <= its length);
            // the destination lies in a region the peer registered with this uffd.
            let r = unsafe { self.uffd.copy((self.src.addr + o) as *const libc::c_void, d as *mut libc::c_void, n as usize, true) };
            match r {
                Ok(c) => {
                    done += c as u64;
                    self.bytes_copied += c as u64;
                }
                // The crate reports EAGAIN as "partially copied": progress when positive,
                // a pending remove event (mmap changing) when not.
                Err(UffdError::PartiallyCopied(c)) if (c as isize) > 0 => {
                    done += c as u64;
                    self.bytes_copied += c as u64;
                }
                Err(UffdError::PartiallyCopied(_)) => self.drain()?,
                Err(UffdError::CopyFailed(e)) if e as i32 == libc::EAGAIN => self.drain()?,
                Err(UffdError::CopyFailed(e)) if e as i32 == libc::EEXIST => done += PAGE,
                // The VM exited with faults still queued (two threads faulting on one page
                // leave a duplicate event): nothing left to serve.
                Err(UffdError::CopyFailed(e)) if e as i32 == libc::ESRCH => {
                    self.gone = true;
                    return Ok(());
                }
                Err(e) => bail!("UFFDIO_COPY at {d:#x} ({n} bytes): {e:?}"),
            }
            // A remove may have landed mid-range: the remaining pages are re-checked above.
            if self.is_removed(dst + done, len - done) {
                for p in (done..len).step_by(PAGE as usize) {
                    self.install(dst + p, fo + p, PAGE)?;
                }
                return Ok(());
            }
        }
        Ok(())
    }
}

fn serve(mut conn: UnixStream, src: &Source, granularity: u64, json: bool) -> anyhow::Result<()> {
    let t0 = Instant::now();
    let pid = getsockopt(&conn, PeerCredentials).map(|c| c.pid()).unwrap_or(0);
    let (regions, uffd) = handshake(&conn)?;
    let mut c = Conn { uffd, regions, src, granularity, removed: Vec::new(), pending: VecDeque::new(), gone: false, faults: 0, bytes_copied: 0 };
    loop {
        let mut fds = [
            libc::pollfd { fd: c.uffd.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: conn.as_raw_fd(), events: libc::POLLIN | libc::POLLRDHUP, revents: 0 },
        ];
        // SAFETY: two valid pollfd structs for fds we own, for the duration of the call.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if rc < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e).context("poll");
        }
        if fds[0].revents & libc::POLLIN != 0 {
            c.drain()?;
            while let Some(addr) = c.pending.pop_front() {
                c.serve_fault(addr)?;
                if c.gone {
                    break;
                }
            }
        }
        if c.gone {
            break;
        }
        if fds[1].revents != 0 {
            // The VM sends nothing after the handshake: readable means it went away.
            let mut b = [0u8; 64];
            if matches!(conn.read(&mut b), Ok(0) | Err(_)) {
                break;
            }
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    if json {
        println!("{}", serde_json::json!({"pid": pid, "faults": c.faults, "bytes_copied": c.bytes_copied, "removed_ranges": c.removed.len(), "seconds": secs}));
    }
    eprintln!("uffd_ref: pid {pid} done: {} faults, {} bytes copied, {:.3} s", c.faults, c.bytes_copied, secs);
    Ok(())
}
