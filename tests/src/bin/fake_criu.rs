//! `fake_criu`: a test runtime that plays `criu dump` and `criu restore --lazy-pages` for
//! the parts a lazy-pages server sees, and checks every page it reads.
//!
//! ```text
//! fake_criu dump DIR --size N --seed S --pid P      writes a CRIU-like image directory:
//!   pagemap-P.img   IMG_COMMON_MAGIC, PAGEMAP_MAGIC, pagemap_head, pagemap_entry...
//!   pages-I.img     the PE_PRESENT entries' pages back to back, in pagemap order
//!   mm-P.json       the VMAs (a stand-in for CRIU's mm-P.img), inventory.img (a marker)
//!   VMAs at a fixed high address, gaps between them, one pair adjacent with different
//!   protections and one pagemap entry across their boundary; entries PRESENT|LAZY,
//!   PRESENT only (restored eagerly), not present (flags 0: zero), holes (no entry: zero),
//!   and with --parent-pages an entry whose pages are in a parent dump (PE_PARENT).
//!
//! fake_criu restore --workdir W --images DIR --pid P [--pid Q ...] [--zombie Z]
//!   maps the VMAs (MAP_FIXED_NOREPLACE), writes the non-lazy pages, creates one
//!   userfaultfd per task (EVENT_REMAP|REMOVE|UNMAP, as CRIU's setup_uffd asks where the
//!   kernel has them), registers the VMAs MISSING, connects to W/lazy-pages.socket and
//!   sends, per task, the int pid then the uffd (one dummy byte + SCM_RIGHTS), -Z per
//!   zombie, then LAZY_PAGES_RESTORE_FINISHED; closes the socket (criu restore exits
//!   once the tasks run), then touches every page from --threads threads.
//! ```
//!
//! Several tasks live in this one process: each has its own uffd over its own VMAs (the
//! dumps of different pids sit at different addresses), which is what the server sees of
//! separate processes. Pages are read with process_vm_readv on ourselves, so a poisoned
//! page is an error return that is counted, not a SIGBUS.
//!
//! Exit codes: 0 every page right (PE_PARENT pages, when expected, poisoned); 1 a wrong
//! byte was seen; 2 error; 3 no wrong byte, but pages poisoned or the server stalled.

use std::io::{IoSlice, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use clap::{Parser, Subcommand};
use lazy::pagemap::{decode_pagemap, encode_pagemap, Pagemap, PagemapEntry, PE_LAZY, PE_PARENT, PE_PRESENT};
use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
use serde::{Deserialize, Serialize};
use snapctl_tests::SplitMix64;
use userfaultfd::{FeatureFlags, Uffd, UffdBuilder};

const PAGE: u64 = 4096;
/// criu/uffd.c LAZY_PAGES_RESTORE_FINISHED.
const RESTORE_FINISHED: u32 = 0x5253_5446;

#[derive(Debug, Parser)]
#[command(about = "A CRIU-like dump/restore for testing a lazy-pages server")]
struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Write a fake CRIU image directory for one task.
    Dump {
        dir: PathBuf,
        /// Bytes of address space the task's VMAs cover (pages: about 70% of it present).
        #[arg(long, default_value = "4MiB", value_parser = imgfmt::size::parse_size)]
        size: u64,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        #[arg(long, default_value_t = 1)]
        pid: i32,
        /// The pages file's id (pages-<id>.img); default: the pid.
        #[arg(long)]
        pages_id: Option<u32>,
        /// Add an entry of this many pages whose content is in a parent dump (PE_PARENT).
        #[arg(long, default_value_t = 0)]
        parent_pages: u32,
    },
    /// Restore the tasks through a lazy-pages server and check every page.
    Restore {
        /// criu's work directory: the server listens on WORKDIR/lazy-pages.socket.
        #[arg(long)]
        workdir: PathBuf,
        /// The dump (the truth every page is compared with).
        #[arg(long)]
        images: PathBuf,
        /// Tasks to restore (each needs pagemap-<pid>.img and mm-<pid>.json in --images).
        #[arg(long = "pid", required = true)]
        pids: Vec<i32>,
        /// Zombies to announce (sent as -pid, no fd).
        #[arg(long = "zombie")]
        zombies: Vec<i32>,
        #[arg(long, default_value_t = 4)]
        threads: usize,
        /// Give up after this many seconds: report "stalled", exit 3 (or 1).
        #[arg(long, default_value_t = 60)]
        timeout: u64,
        /// Print a JSON summary on stdout.
        #[arg(long)]
        json: bool,
    },
}

/// One VMA of the fake task (CRIU keeps these in mm-<pid>.img).
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct Vma {
    start: u64,
    end: u64,
    writable: bool,
}

/// Where a pid's dump lives in the address space: 16 GiB apart per pid, high up but below
/// the libraries and stack (0x7fxx_...) of a 47-bit address space.
fn base_of(pid: i32) -> u64 {
    0x7e00_0000_0000 + (pid.unsigned_abs() as u64 % 64) * (16 << 30)
}

/// The dump's VMAs and pagemap entries (deterministic in size, seed, pid).
fn plan(size: u64, seed: u64, pid: i32, parent_pages: u32) -> (Vec<Vma>, Vec<PagemapEntry>) {
    let pages = (size / PAGE).max(64);
    // Four VMAs: a gap after the first and second, the third and fourth adjacent (RW then
    // read-only, so the kernel keeps them apart).
    let per = pages / 4;
    let gap = 16 << 20;
    let mut vmas = Vec::new();
    let mut at = base_of(pid);
    for i in 0..4 {
        let len = if i == 3 { (pages - 3 * per) * PAGE } else { per * PAGE };
        vmas.push(Vma { start: at, end: at + len, writable: i != 3 });
        at += len + if i < 2 { gap } else { 0 };
    }
    let mut rng = SplitMix64(seed ^ (pid as u64).wrapping_mul(0x51));
    let mut entries: Vec<PagemapEntry> = Vec::new();
    for v in &vmas {
        let mut a = v.start;
        while a < v.end {
            let left = (v.end - a) / PAGE;
            let n = (1 + rng.next_u64() % 48).min(left);
            let kind = rng.next_u64() % 10;
            let flags = match kind {
                0..=5 => Some(PE_PRESENT | PE_LAZY),
                6 => Some(PE_PRESENT),
                7 => Some(0),
                _ => None, // a hole: no entry, a zero page
            };
            if let Some(flags) = flags {
                entries.push(PagemapEntry { vaddr: a, nr_pages: n as u32, flags });
            }
            a += n * PAGE;
        }
    }
    // One lazy entry across the boundary of VMAs 2 and 3 (CRIU's pagemap entries may cover
    // adjacent VMAs), replacing whatever the window overlapped.
    let window = (vmas[2].end - 4 * PAGE, vmas[2].end + 4 * PAGE);
    entries.retain(|e| e.end() <= window.0 || e.vaddr >= window.1);
    entries.push(PagemapEntry { vaddr: window.0, nr_pages: 8, flags: PE_PRESENT | PE_LAZY });
    entries.sort_by_key(|e| e.vaddr);
    if parent_pages > 0 {
        // The first VMA's first entry becomes a parent entry.
        if let Some(e) = entries.first_mut() {
            e.nr_pages = e.nr_pages.min(parent_pages).max(1);
            e.flags = PE_PARENT;
        }
    }
    (vmas, entries)
}

/// A present page's content: non-zero everywhere (so no pages-file chunk is a zero chunk
/// and every zero the task reads comes from a zero page, not from data).
fn fill_page(seed: u64, vaddr: u64, buf: &mut [u8]) {
    let mut r = SplitMix64(seed ^ vaddr);
    for c in buf.chunks_mut(8) {
        let v = r.next_u64() | 1;
        c.copy_from_slice(&v.to_le_bytes()[..c.len()]);
    }
}

fn dump(dir: &Path, size: u64, seed: u64, pid: i32, pages_id: Option<u32>, parent_pages: u32) -> anyhow::Result<u8> {
    ensure!(pid > 0, "--pid must be positive");
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    let pages_id = pages_id.unwrap_or(pid as u32);
    let (vmas, entries) = plan(size, seed, pid, parent_pages);
    let mut pages = Vec::new();
    let mut buf = vec![0u8; PAGE as usize];
    for e in entries.iter().filter(|e| e.present()) {
        for p in 0..e.nr_pages as u64 {
            fill_page(seed, e.vaddr + p * PAGE, &mut buf);
            pages.extend_from_slice(&buf);
        }
    }
    let pm = Pagemap { pages_id, entries };
    let write = |name: String, b: &[u8]| std::fs::write(dir.join(&name), b).with_context(|| format!("write {name}"));
    write(format!("pagemap-{pid}.img"), &encode_pagemap(&pm))?;
    write(format!("pages-{pages_id}.img"), &pages)?;
    write(format!("mm-{pid}.json"), &serde_json::to_vec(&vmas)?)?;
    // CRIU's inventory marks the directory as a dump (snapctl pack detects kind criu).
    write("inventory.img".into(), &0x5831_3116u32.to_le_bytes())?;
    let count = |f: fn(&PagemapEntry) -> bool| pm.entries.iter().filter(|e| f(e)).map(|e| e.nr_pages as u64).sum::<u64>();
    let summary = serde_json::json!({
        "pid": pid, "pages_id": pages_id,
        "vma_pages": vmas.iter().map(|v| (v.end - v.start) / PAGE).sum::<u64>(),
        "present_pages": count(|e| e.present()),
        "lazy_pages": count(|e| e.present() && e.lazy()),
        "parent_pages": count(|e| e.in_parent()),
        "entries": pm.entries.len(),
    });
    println!("{summary}");
    Ok(0)
}

/// One task being restored.
struct Task {
    pid: i32,
    vmas: Vec<Vma>,
    pagemap: Pagemap,
    /// (vaddr, offset in pages) of each present entry, for the expected content.
    pages: Vec<u8>,
    /// Closed once sent, as CRIU's restorer closes its copy: the registration must live
    /// only as long as the server's copy does.
    uffd: Option<Uffd>,
}

/// What a page should read as.
enum Want<'a> {
    Zero,
    Data(&'a [u8]),
    /// In a parent dump: the server cannot serve it; poison expected.
    Parent,
}

impl Task {
    fn want(&self, addr: u64) -> Want<'_> {
        let i = self.pagemap.entries.partition_point(|e| e.vaddr <= addr);
        let Some(e) = i.checked_sub(1).map(|i| &self.pagemap.entries[i]).filter(|e| addr < e.end()) else { return Want::Zero };
        if e.in_parent() {
            return Want::Parent;
        }
        if !e.present() {
            return Want::Zero;
        }
        let r = self.pagemap.runs().into_iter().find(|r| r.vaddr == e.vaddr).expect("present entry has a run");
        let off = (r.offset + addr - e.vaddr) as usize;
        Want::Data(&self.pages[off..off + PAGE as usize])
    }
}

fn map_task(images: &Path, pid: i32) -> anyhow::Result<Task> {
    let pm = std::fs::read(images.join(format!("pagemap-{pid}.img"))).with_context(|| format!("read pagemap-{pid}.img"))?;
    let pagemap = decode_pagemap(&pm).with_context(|| format!("pagemap-{pid}.img"))?;
    let pages_path = images.join(format!("pages-{}.img", pagemap.pages_id));
    let pages = std::fs::read(&pages_path).with_context(|| format!("read {}", pages_path.display()))?;
    ensure!(pages.len() as u64 >= pagemap.pages_bytes(), "{} is short", pages_path.display());
    let vmas: Vec<Vma> = serde_json::from_slice(&std::fs::read(images.join(format!("mm-{pid}.json")))?)?;
    for v in &vmas {
        // SAFETY: MAP_FIXED_NOREPLACE never replaces an existing mapping; the range is the
        // dump's, far above anything this process maps on its own.
        let p = unsafe {
            libc::mmap(
                v.start as *mut libc::c_void,
                (v.end - v.start) as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        ensure!(p as u64 == v.start, "map VMA {:#x}-{:#x}: {}", v.start, v.end, std::io::Error::last_os_error());
    }
    // Non-lazy present pages are restored eagerly, before the uffd exists (as CRIU's
    // restorer reads them in).
    for r in pagemap.runs().iter().filter(|r| !r.lazy) {
        let src = &pages[r.offset as usize..(r.offset + r.len) as usize];
        // SAFETY: [vaddr, vaddr+len) lies in a VMA mapped read-write just above.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), r.vaddr as *mut u8, r.len as usize) };
    }
    for v in vmas.iter().filter(|v| !v.writable) {
        // SAFETY: our own mapping.
        let rc = unsafe { libc::mprotect(v.start as *mut libc::c_void, (v.end - v.start) as usize, libc::PROT_READ) };
        ensure!(rc == 0, "mprotect: {}", std::io::Error::last_os_error());
    }
    let uffd = UffdBuilder::new()
        .close_on_exec(true)
        .non_blocking(true)
        .user_mode_only(false)
        .require_features(FeatureFlags::EVENT_REMAP | FeatureFlags::EVENT_REMOVE | FeatureFlags::EVENT_UNMAP)
        .create()
        .context("create userfaultfd (needs root or vm.unprivileged_userfaultfd=1)")?;
    for v in &vmas {
        uffd.register(v.start as *mut libc::c_void, (v.end - v.start) as usize).context("UFFDIO_REGISTER (MISSING)")?;
    }
    Ok(Task { pid, vmas, pagemap, pages, uffd: Some(uffd) })
}

/// Copy a page through the kernel, so a poisoned page is an error rather than SIGBUS.
fn read_page(addr: u64, buf: &mut [u8]) -> Result<(), i32> {
    let local = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    let remote = libc::iovec { iov_base: addr as *mut libc::c_void, iov_len: buf.len() };
    // SAFETY: `local` is our writable buffer; the kernel reads `remote` with fault handling.
    let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
    if n == buf.len() as isize {
        Ok(())
    } else if n < 0 {
        Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
    } else {
        Err(libc::EFAULT)
    }
}

#[derive(Default)]
struct Counters {
    checked: AtomicU64,
    mismatches: AtomicU64,
    poisoned: AtomicU64,
    parent_poisoned: AtomicU64,
    zero: AtomicU64,
}

impl Counters {
    fn json(&self, stalled: bool, seconds: f64, tasks: usize) -> serde_json::Value {
        let l = |a: &AtomicU64| a.load(Ordering::SeqCst);
        serde_json::json!({
            "tasks": tasks,
            "pages_checked": l(&self.checked),
            "mismatches": l(&self.mismatches),
            "poisoned": l(&self.poisoned),
            "parent_poisoned": l(&self.parent_poisoned),
            "zero_pages_seen": l(&self.zero),
            "stalled": stalled,
            "seconds": seconds,
        })
    }
    fn code(&self) -> u8 {
        if self.mismatches.load(Ordering::SeqCst) > 0 {
            1
        } else if self.poisoned.load(Ordering::SeqCst) > 0 {
            3
        } else {
            0
        }
    }
}

fn connect(path: &Path) -> anyhow::Result<UnixStream> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match UnixStream::connect(path) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() < deadline && matches!(e.kind(), std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused) => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(e).with_context(|| format!("connect to {}", path.display())),
        }
    }
}

fn restore(workdir: &Path, images: &Path, pids: &[i32], zombies: &[i32], threads: usize, timeout: u64, json: bool) -> anyhow::Result<u8> {
    ensure!((1..=64).contains(&threads), "--threads must be 1..=64");
    let mut seen = std::collections::HashSet::new();
    for p in pids {
        ensure!(*p > 0 && seen.insert(p.unsigned_abs() % 64), "pids must be positive and differ modulo 64 (their dumps' address ranges)");
    }
    let mut tasks: Vec<Task> = pids.iter().map(|&p| map_task(images, p)).collect::<anyhow::Result<_>>()?;

    // criu restore: prepare_lazy_pages_socket connects; each task's setup_uffd sends its
    // pid and then its uffd; zombies send -pid only; lazy_pages_finish_restore sends RSTF.
    let sock = connect(&workdir.join("lazy-pages.socket"))?;
    for t in &mut tasks {
        (&sock).write_all(&t.pid.to_ne_bytes()).context("send pid")?;
        let uffd = t.uffd.take().expect("not sent yet");
        let fds = [uffd.as_raw_fd()];
        let n = sendmsg::<()>(sock.as_raw_fd(), &[IoSlice::new(&[0])], &[ControlMessage::ScmRights(&fds)], MsgFlags::empty(), None)
            .context("send the userfaultfd")?;
        ensure!(n == 1, "short sendmsg");
        drop(uffd);
    }
    for z in zombies {
        (&sock).write_all(&(-z).to_ne_bytes()).context("send zombie pid")?;
    }
    (&sock).write_all(&RESTORE_FINISHED.to_ne_bytes()).context("send RESTORE_FINISHED")?;
    drop(sock);

    let counters = Arc::new(Counters::default());
    let start = Instant::now();
    {
        let c = counters.clone();
        let n = tasks.len();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(timeout));
            eprintln!("fake_criu: the lazy-pages server stalled: not done after {timeout} s");
            if json {
                println!("{}", c.json(true, timeout as f64, n));
            }
            let _ = std::io::stdout().flush();
            std::process::exit(if c.mismatches.load(Ordering::SeqCst) > 0 { 1 } else { 3 });
        });
    }
    // Every page of every VMA of every task, interleaved across tasks.
    let mut all: Vec<(usize, u64)> = Vec::new();
    for (i, t) in tasks.iter().enumerate() {
        for v in &t.vmas {
            all.extend((v.start..v.end).step_by(PAGE as usize).map(|a| (i, a)));
        }
    }
    SplitMix64(0x5eed).shuffle(&mut all);
    let tasks = Arc::new(tasks);
    let all = Arc::new(all);
    let next = Arc::new(AtomicUsize::new(0));
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let (tasks, all, next, c) = (tasks.clone(), all.clone(), next.clone(), counters.clone());
            std::thread::spawn(move || {
                let mut got = vec![0u8; PAGE as usize];
                while let Some(&(ti, addr)) = all.get(next.fetch_add(1, Ordering::Relaxed)) {
                    let t = &tasks[ti];
                    let r = read_page(addr, &mut got);
                    c.checked.fetch_add(1, Ordering::SeqCst);
                    match (t.want(addr), r) {
                        (Want::Parent, Err(_)) => {
                            c.parent_poisoned.fetch_add(1, Ordering::SeqCst);
                        }
                        (Want::Parent, Ok(())) => {
                            // Whatever it reads, it is not the parent dump's content.
                            if c.mismatches.fetch_add(1, Ordering::SeqCst) < 5 {
                                eprintln!("fake_criu: pid {}: page {addr:#x} is in a parent dump but read back without an error", t.pid);
                            }
                        }
                        (_, Err(errno)) => {
                            if c.poisoned.fetch_add(1, Ordering::SeqCst) < 5 {
                                eprintln!("fake_criu: pid {}: page {addr:#x} unreadable (errno {errno}): poisoned", t.pid);
                            }
                        }
                        (Want::Zero, Ok(())) => {
                            if got.iter().all(|&b| b == 0) {
                                c.zero.fetch_add(1, Ordering::SeqCst);
                            } else if c.mismatches.fetch_add(1, Ordering::SeqCst) < 5 {
                                eprintln!("fake_criu: pid {}: MISMATCH: zero page {addr:#x} is not zero", t.pid);
                            }
                        }
                        (Want::Data(w), Ok(())) => {
                            if got != w && c.mismatches.fetch_add(1, Ordering::SeqCst) < 5 {
                                eprintln!("fake_criu: pid {}: MISMATCH at page {addr:#x}", t.pid);
                            }
                        }
                    }
                }
            })
        })
        .collect();
    for h in handles {
        h.join().map_err(|_| anyhow::anyhow!("a touch thread panicked"))?;
    }
    let summary = counters.json(false, start.elapsed().as_secs_f64(), tasks.len());
    if json {
        println!("{summary}");
    }
    eprintln!("fake_criu: {summary}");
    Ok(counters.code())
}

fn main() -> ExitCode {
    let a = Args::parse();
    let r = match a.cmd {
        Cmd::Dump { dir, size, seed, pid, pages_id, parent_pages } => dump(&dir, size, seed, pid, pages_id, parent_pages),
        Cmd::Restore { workdir, images, pids, zombies, threads, timeout, json } => restore(&workdir, &images, &pids, &zombies, threads, timeout, json),
    };
    match r {
        Ok(c) => ExitCode::from(c),
        Err(e) => {
            eprintln!("fake_criu: {e:#}");
            ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_are_sorted_disjoint_and_mix_every_kind() {
        let (vmas, entries) = plan(4 << 20, 3, 7, 2);
        assert_eq!(vmas.len(), 4);
        assert!(vmas[1].start > vmas[0].end && vmas[2].start > vmas[1].end, "gaps after the first two VMAs");
        assert_eq!(vmas[3].start, vmas[2].end, "the last two are adjacent");
        for w in entries.windows(2) {
            assert!(w[0].end() <= w[1].vaddr, "{w:?}");
        }
        // Every entry lies in the VMAs.
        for e in &entries {
            let inside = |a: u64| vmas.iter().any(|v| a >= v.start && a < v.end);
            assert!(inside(e.vaddr) && inside(e.end() - 1), "{e:?}");
        }
        let has = |f: u32| entries.iter().any(|e| e.flags == f);
        assert!(has(PE_PRESENT | PE_LAZY) && has(PE_PRESENT) && has(0) && has(PE_PARENT));
        assert!(entries.iter().any(|e| e.vaddr < vmas[2].end && e.end() > vmas[2].end && e.lazy()), "an entry across the adjacent VMAs");
        let pm = Pagemap { pages_id: 1, entries };
        assert_eq!(decode_pagemap(&encode_pagemap(&pm)).unwrap(), pm);
    }
}
