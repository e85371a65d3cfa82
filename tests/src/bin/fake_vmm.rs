//! `fake_vmm`: a test runtime that restores guest memory the way Firecracker does with a
//! UFFD memory backend, and checks every byte it sees against the original memory file.
//!
//! ```text
//!  guest "physical" memory (anonymous, private; with --page-size 2MiB on 2 MiB huge
//!  pages, MAP_HUGETLB, as Firecracker's `"huge_pages": "2M"`), two regions with a
//!  PROT_NONE gap:
//!  [ region 0: file 0 .. a ]  <gap>  [ region 1: file a .. end ]
//!        |  userfaultfd (MISSING, EVENT_REMOVE) + JSON mappings, one sendmsg
//!        v
//!  the page-fault handler on --socket (snapctl lazy, or bench's uffd_ref)
//! ```
//!
//! The handshake is Firecracker's: one `sendmsg` on a Unix stream socket carrying the JSON
//! array `[{base_host_virt_addr, size, offset, page_size, page_size_kib}]` (page sizes in
//! bytes, as Firecracker sends them despite the name) and the userfaultfd as SCM_RIGHTS.
//! The socket stays open while the "VM" runs; the handler sees the VM go away when it closes.
//!
//! Pages are read through `process_vm_readv` on our own pid rather than by dereferencing:
//! the kernel copies from user memory, so a page the handler poisoned (UFFDIO_POISON) comes
//! back as an error we count as "poisoned" instead of a SIGBUS that would kill the check.
//!
//! Exit codes: 0 every checked page matched; 1 a wrong byte was seen (mismatch, or a
//! removed range not reading back as zeros); 2 error (setup, handshake); 3 no wrong byte,
//! but pages were poisoned or the handler stalled past --timeout.

use std::fs::File;
use std::io::{IoSlice, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use clap::Parser;
use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
use snapctl_tests::SplitMix64;
use userfaultfd::{FeatureFlags, UffdBuilder};

/// What the guest touches and checks: its own 4 KiB pages, whatever backs them.
const PAGE: u64 = 4096;
/// The other backing page size: 2 MiB huge pages (hugetlbfs), whose faults the handler
/// fills a whole huge page at a time.
const HUGE_PAGE: u64 = 2 << 20;
/// Virtual address space left unmapped (PROT_NONE) between regions, like the x86 MMIO gap
/// below 4 GiB, scaled down. Touching it would fault without the handler ever hearing.
const GAP: u64 = 256 << 20;

#[derive(Debug, Parser)]
#[command(about = "A Firecracker-like runtime restoring guest memory through userfaultfd")]
struct Args {
    /// The page-fault handler's Unix socket (as Firecracker's mem_backend.backend_path).
    #[arg(long)]
    socket: PathBuf,
    /// The original memory file: the truth each page is compared with.
    #[arg(long)]
    mem_file: PathBuf,
    /// Guest memory regions: a count N (the file split into N page-aligned parts, the
    /// last taking the rest), or OFF:LEN,OFF:LEN,... file ranges (sizes take K/M/G/KiB/MiB/GiB).
    #[arg(long, default_value = "2")]
    regions: String,
    /// The pages backing guest memory: 4KiB, or 2MiB (MAP_HUGETLB: reserve huge pages
    /// first, /proc/sys/vm/nr_hugepages; the mapping fails without them). Regions are then
    /// whole huge pages, and the handshake sends this size for each one.
    #[arg(long, default_value = "4KiB")]
    page_size: String,
    /// Send this page size in the handshake instead of --page-size's (a runtime that gets
    /// it wrong: the handler must refuse it, not stall on it).
    #[arg(long)]
    handshake_page_size: Option<u64>,
    /// Threads touching pages ("vCPUs").
    #[arg(long, default_value_t = 4)]
    threads: usize,
    /// Which pages to touch: all, PCT% (a random sample), or a list of file page numbers
    /// and ranges ("0,7,100-131").
    #[arg(long, default_value = "all")]
    touch: String,
    /// Seed of the random touch order and sample (same seed, same order).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// With PCT%: pick the sample as runs of this many contiguous pages (a guest's working
    /// set is clustered: kernel text, hot page cache, heap), not as scattered single pages.
    #[arg(long, default_value_t = 1)]
    run_pages: u64,
    /// After touching, madvise(MADV_DONTNEED) this file range (OFF:LEN, in one region) and
    /// check it reads back as zeros: the handler sees UFFD_EVENT_REMOVE.
    #[arg(long)]
    dontneed: Option<String>,
    /// Give up after this many seconds (0 = never): report "stalled" and exit 3.
    #[arg(long, default_value_t = 0)]
    timeout: u64,
    /// Print a JSON summary on stdout.
    #[arg(long)]
    json: bool,
    /// Wait this many milliseconds between the handshake and the first touch (a guest
    /// that is slow to start: tests stop the handler in between).
    #[arg(long, default_value_t = 0)]
    pause_ms: u64,
    /// After the --touch pages, create PATH.waiting, wait (running, its memory mapped) until
    /// PATH exists, then touch the --then-touch pages: a guest that lives on while a test
    /// changes the world around it (a tag moved, a gc).
    #[arg(long, value_name = "PATH", requires = "then_touch")]
    then_wait_for: Option<PathBuf>,
    /// The pages to touch after --then-wait-for (as --touch).
    #[arg(long, value_name = "PAGES", requires = "then_wait_for")]
    then_touch: Option<String>,
}

/// One guest memory region: where it lives in our address space and in the memory file.
#[derive(Debug, Clone, Copy)]
struct Region {
    base: u64,
    size: u64,
    offset: u64,
}

fn parse_range(s: &str) -> anyhow::Result<(u64, u64)> {
    let (off, len) = s.split_once(':').with_context(|| format!("expected OFF:LEN, got {s:?}"))?;
    // snapctl's own size syntax (`9MiB`, `32KiB`, bytes).
    let size = |t: &str| imgfmt::size::parse_size(t).map_err(anyhow::Error::msg);
    Ok((size(off)?, size(len)?))
}

/// File ranges of the regions, aligned to the backing `page`, inside the (page-rounded) file.
fn plan_regions(spec: &str, file_len: u64, page: u64) -> anyhow::Result<Vec<(u64, u64)>> {
    let total = file_len.div_ceil(page) * page;
    ensure!(total > 0, "the memory file is empty");
    let ranges: Vec<(u64, u64)> = if let Ok(n) = spec.trim().parse::<u64>() {
        ensure!((1..=16).contains(&n), "--regions count must be 1..=16, got {n}");
        let pages = total / page;
        ensure!(pages >= n, "{n} regions need at least {n} pages of {page} B; the file has {pages}");
        let per = pages / n;
        (0..n)
            .map(|i| {
                let off = i * per * page;
                let len = if i + 1 == n { total - off } else { per * page };
                (off, len)
            })
            .collect()
    } else {
        spec.split(',').map(parse_range).collect::<anyhow::Result<_>>()?
    };
    for &(off, len) in &ranges {
        ensure!(off % page == 0 && len % page == 0 && len > 0, "region {off}:{len} is not a non-empty run of {page} B pages");
        ensure!(off.checked_add(len).is_some_and(|e| e <= total), "region {off}:{len} goes past the memory file ({file_len} bytes)");
    }
    Ok(ranges)
}

/// Map the regions into one PROT_NONE reservation with a gap after each one, as anonymous
/// private memory (what Firecracker maps for a UFFD backend), on huge pages when `page`
/// is [`HUGE_PAGE`] (reserved at map time: no huge pages, no mapping, rather than a
/// SIGBUS at some later touch). The mapping lives until exit.
fn map_guest(ranges: &[(u64, u64)], page: u64) -> anyhow::Result<Vec<Region>> {
    let backing = if page == HUGE_PAGE { libc::MAP_HUGETLB | libc::MAP_HUGE_2MB } else { libc::MAP_NORESERVE };
    const ALIGN: u64 = 2 << 20;
    let span: u64 = ranges.iter().map(|&(_, len)| len.div_ceil(ALIGN) * ALIGN + GAP).sum::<u64>() + ALIGN;
    // SAFETY: a fresh anonymous reservation; no existing memory is touched.
    let res = unsafe { libc::mmap(std::ptr::null_mut(), span as usize, libc::PROT_NONE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE, -1, 0) };
    ensure!(res != libc::MAP_FAILED, "reserve {span} bytes of address space: {}", std::io::Error::last_os_error());
    let mut at = (res as u64).div_ceil(ALIGN) * ALIGN;
    let mut regions = Vec::new();
    for &(offset, size) in ranges {
        // SAFETY: MAP_FIXED inside our own reservation, which nothing else uses.
        let p = unsafe {
            libc::mmap(
                at as *mut libc::c_void,
                size as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED | backing,
                -1,
                0,
            )
        };
        let hint = if page == HUGE_PAGE { " (2 MiB huge pages: are enough reserved? /proc/sys/vm/nr_hugepages)" } else { "" };
        ensure!(p != libc::MAP_FAILED, "map region of {size} bytes: {}{hint}", std::io::Error::last_os_error());
        regions.push(Region { base: at, size, offset });
        at += size.div_ceil(ALIGN) * ALIGN + GAP;
    }
    Ok(regions)
}

/// File page numbers to touch, in touch order.
fn plan_touches(spec: &str, regions: &[Region], seed: u64, run_pages: u64) -> anyhow::Result<Vec<u64>> {
    let mut all: Vec<u64> = regions.iter().flat_map(|r| (r.offset / PAGE)..(r.offset + r.size) / PAGE).collect();
    let mut rng = SplitMix64(seed);
    let spec = spec.trim();
    if spec == "all" {
        rng.shuffle(&mut all);
        return Ok(all);
    }
    if let Some(pct) = spec.strip_suffix('%') {
        let pct: f64 = pct.trim().parse().with_context(|| format!("bad percentage {spec:?}"))?;
        ensure!(pct > 0.0 && pct <= 100.0, "--touch percentage must be in (0, 100], got {pct}");
        let n = ((all.len() as f64 * pct / 100.0).ceil() as usize).clamp(1, all.len());
        if run_pages <= 1 {
            rng.shuffle(&mut all);
            all.truncate(n);
            return Ok(all);
        }
        // Runs of contiguous pages (in file order) at random starts until n pages are picked.
        let run = run_pages.min(all.len() as u64) as usize;
        let mut picked = vec![false; all.len()];
        let mut count = 0;
        while count < n {
            let start = (rng.next_u64() % (all.len() - run + 1) as u64) as usize;
            for p in &mut picked[start..start + run] {
                if !*p && count < n {
                    *p = true;
                    count += 1;
                }
            }
        }
        let mut sample: Vec<u64> = all.iter().zip(&picked).filter(|(_, &p)| p).map(|(&pg, _)| pg).collect();
        rng.shuffle(&mut sample);
        return Ok(sample);
    }
    let mapped = |p: u64| regions.iter().any(|r| p * PAGE >= r.offset && p * PAGE < r.offset + r.size);
    let mut out = Vec::new();
    for item in spec.split(',') {
        let (a, b) = match item.split_once('-') {
            Some((a, b)) => (a.trim().parse::<u64>()?, b.trim().parse::<u64>()?),
            None => {
                let a = item.trim().parse::<u64>().with_context(|| format!("bad page number {item:?}"))?;
                (a, a)
            }
        };
        ensure!(a <= b, "bad page range {item:?}");
        for p in a..=b {
            ensure!(mapped(p), "page {p} is in no region");
            out.push(p);
        }
    }
    Ok(out)
}

fn guest_addr(regions: &[Region], file_off: u64) -> Option<u64> {
    regions.iter().find(|r| file_off >= r.offset && file_off < r.offset + r.size).map(|r| r.base + (file_off - r.offset))
}

/// What reading one guest page gave.
enum Read {
    Ok,
    /// The kernel could not copy it: a poisoned page (or a handler that gave up).
    Poisoned(i32),
}

/// Copy a guest page into `buf` through the kernel (process_vm_readv on ourselves), so a
/// poisoned page is an error return rather than SIGBUS.
fn read_guest_page(addr: u64, buf: &mut [u8]) -> Read {
    let local = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    let remote = libc::iovec { iov_base: addr as *mut libc::c_void, iov_len: buf.len() };
    // SAFETY: `local` is our own writable buffer of iov_len bytes; `remote` is read by the
    // kernel with fault handling (an unreadable page is an error, not a crash).
    let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
    if n == buf.len() as isize {
        Read::Ok
    } else if n < 0 {
        Read::Poisoned(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
    } else {
        // A short copy: the page's tail could not be read.
        Read::Poisoned(libc::EFAULT)
    }
}

/// Whether the guest page at `addr` is installed (mincore: resident). Checked before a
/// touch: a page the handler installs meanwhile (in flight) then counts as missing.
fn page_resident(addr: u64) -> bool {
    let mut v = 0u8;
    // SAFETY: mincore on one page of our own mapping, writing one byte into `v`.
    let rc = unsafe { libc::mincore(addr as *mut libc::c_void, PAGE as usize, &mut v) };
    rc == 0 && v & 1 == 1
}

/// The original bytes at a file offset (zeros past the end of the file).
fn original_page(f: &File, file_len: u64, off: u64, buf: &mut [u8]) -> anyhow::Result<()> {
    buf.fill(0);
    if off < file_len {
        let n = ((file_len - off) as usize).min(buf.len());
        f.read_exact_at(&mut buf[..n], off).with_context(|| format!("read memory file at {off}"))?;
    }
    Ok(())
}

#[derive(Default)]
struct Counters {
    checked: AtomicU64,
    /// Touches that found their page not yet installed (mincore said not resident).
    missing: AtomicU64,
    mismatches: AtomicU64,
    poisoned: AtomicU64,
    zero: AtomicU64,
    /// Microseconds since the Unix epoch when the first touch of any thread returned (0:
    /// none yet): with the handshake's time, how long the guest waited for its first page.
    first_touch_unix_us: AtomicU64,
}

/// Microseconds since the Unix epoch: comparable with a benchmark script's `date +%s.%N`.
fn unix_us() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}

fn percentile(sorted_ns: &[u64], p: f64) -> f64 {
    if sorted_ns.is_empty() {
        return 0.0;
    }
    let i = ((sorted_ns.len() as f64 - 1.0) * p).round() as usize;
    sorted_ns[i] as f64 / 1000.0
}

fn main() -> ExitCode {
    match run() {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("fake_vmm: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn run() -> anyhow::Result<u8> {
    let a = Args::parse();
    ensure!(a.threads >= 1 && a.threads <= 256, "--threads must be 1..=256");
    let mem = File::open(&a.mem_file).with_context(|| format!("open {}", a.mem_file.display()))?;
    let file_len = mem.metadata()?.len();
    let page = imgfmt::size::parse_size(&a.page_size).map_err(anyhow::Error::msg)?;
    ensure!(page == PAGE || page == HUGE_PAGE, "--page-size must be 4KiB or 2MiB, got {}", a.page_size);
    let regions = map_guest(&plan_regions(&a.regions, file_len, page)?, page)?;
    let mut phases = vec![plan_touches(&a.touch, &regions, a.seed, a.run_pages)?];
    if let Some(t) = &a.then_touch {
        phases.push(plan_touches(t, &regions, a.seed.wrapping_add(1), a.run_pages)?);
    }
    let dontneed = a.dontneed.as_deref().map(parse_range).transpose()?;
    if let Some((off, len)) = dontneed {
        ensure!(off % page == 0 && len % page == 0 && len > 0, "--dontneed must be whole pages of {page} B");
        ensure!(regions.iter().any(|r| off >= r.offset && off + len <= r.offset + r.size), "--dontneed {off}:{len} must lie inside one region");
    }

    // Non-blocking, with remove events, kernel faults allowed (process_vm_readv faults in
    // kernel mode): the flags Firecracker uses for its UFFD backend.
    let uffd = UffdBuilder::new()
        .close_on_exec(true)
        .non_blocking(true)
        .user_mode_only(false)
        .require_features(FeatureFlags::EVENT_REMOVE)
        .create()
        .context("create userfaultfd (needs root or vm.unprivileged_userfaultfd=1)")?;
    for r in &regions {
        uffd.register(r.base as *mut libc::c_void, r.size as usize).context("UFFDIO_REGISTER (MISSING)")?;
    }

    let mappings: Vec<serde_json::Value> = regions
        .iter()
        .map(|r| {
            serde_json::json!({
                "base_host_virt_addr": r.base, "size": r.size, "offset": r.offset,
                "page_size": a.handshake_page_size.unwrap_or(page), "page_size_kib": a.handshake_page_size.unwrap_or(page),
            })
        })
        .collect();
    let body = serde_json::to_vec(&mappings)?;
    let sock = connect(&a.socket)?;
    let connected_unix_us = unix_us();
    let fds = [uffd.as_raw_fd()];
    let sent = sendmsg::<()>(sock.as_raw_fd(), &[IoSlice::new(&body)], &[ControlMessage::ScmRights(&fds)], MsgFlags::empty(), None)
        .context("sendmsg mappings + userfaultfd")?;
    ensure!(sent == body.len(), "short sendmsg: {sent} of {} bytes", body.len());
    let handshake_unix_us = unix_us();
    std::thread::sleep(Duration::from_millis(a.pause_ms));

    let counters = Arc::new(Counters::default());
    let start = Instant::now();
    if a.timeout > 0 {
        let c = counters.clone();
        let json = a.json;
        let limit = Duration::from_secs(a.timeout);
        std::thread::spawn(move || {
            std::thread::sleep(limit);
            // The handler has not served our faults in time; the touching threads are stuck
            // in the kernel and cannot be joined. Say what we saw and leave.
            let v = serde_json::json!({
                "stalled": true,
                "pages_checked": c.checked.load(Ordering::SeqCst),
                "mismatches": c.mismatches.load(Ordering::SeqCst),
                "poisoned": c.poisoned.load(Ordering::SeqCst),
                "zero_pages_seen": c.zero.load(Ordering::SeqCst),
                "seconds": limit.as_secs_f64(),
            });
            eprintln!("fake_vmm: the handler stalled: not done after {} s", limit.as_secs());
            if json {
                println!("{v}");
            }
            let _ = std::io::stdout().flush();
            let code = if c.mismatches.load(Ordering::SeqCst) > 0 { 1 } else { 3 };
            std::process::exit(code);
        });
    }

    let latencies = Arc::new(Mutex::new(Vec::new()));
    // First touches of pages whose original bytes are not all zero (the ones a page server
    // has to fetch; zero pages it fills without fetching anything), with whether the page
    // was missing when the thread went to touch it (a fault) or already installed.
    let data_latencies: Arc<Mutex<Vec<(u64, bool)>>> = Arc::new(Mutex::new(Vec::new()));
    let data_chunks: Arc<Mutex<Vec<u64>>> = Arc::new(Mutex::new(Vec::new()));
    let regions = Arc::new(regions);
    let mem = Arc::new(mem);
    for (phase, touches) in phases.into_iter().enumerate() {
        if phase > 0 {
            let wait = a.then_wait_for.as_ref().expect("a second phase waits");
            let mut flag = wait.clone().into_os_string();
            flag.push(".waiting");
            std::fs::write(&flag, b"").with_context(|| format!("create {}", PathBuf::from(&flag).display()))?;
            eprintln!("fake_vmm: waiting for {}", wait.display());
            while !wait.exists() {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let touches = Arc::new(touches);
        let next = Arc::new(AtomicUsize::new(0));
        let mut handles = Vec::new();
        for _ in 0..a.threads {
            let (touches, next, lat, regions, mem, c) = (touches.clone(), next.clone(), latencies.clone(), regions.clone(), mem.clone(), counters.clone());
            let data_lat = data_latencies.clone();
            let chunks = data_chunks.clone();
            handles.push(std::thread::spawn(move || -> anyhow::Result<()> {
                let mut got = vec![0u8; PAGE as usize];
                let mut want = vec![0u8; PAGE as usize];
                let mut mine = Vec::new();
                let mut mine_data = Vec::new();
                // The 1 MiB units (snapctl's default chunk) of the data pages touched.
                let mut mine_chunks = Vec::new();
                loop {
                    // Shared cursor: together the threads follow the planned order closely.
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&page) = touches.get(i) else { break };
                    let off = page * PAGE;
                    let addr = guest_addr(&regions, off).expect("planned pages are mapped");
                    let missing = !page_resident(addr);
                    if missing {
                        c.missing.fetch_add(1, Ordering::Relaxed);
                    }
                    let t = Instant::now();
                    let r = read_guest_page(addr, &mut got);
                    let took = t.elapsed().as_nanos() as u64;
                    mine.push(took);
                    match r {
                        Read::Poisoned(errno) => {
                            if c.poisoned.fetch_add(1, Ordering::SeqCst) < 5 {
                                eprintln!("fake_vmm: page at file offset {off:#x} unreadable (errno {errno}): poisoned");
                            }
                        }
                        Read::Ok => {
                            original_page(&mem, file_len, off, &mut want)?;
                            if want.iter().any(|&b| b != 0) {
                                mine_data.push((took, missing));
                                mine_chunks.push(off >> 20);
                            }
                            if got != want {
                                if c.mismatches.fetch_add(1, Ordering::SeqCst) < 5 {
                                    let at = got.iter().zip(&want).position(|(x, y)| x != y).unwrap_or(0);
                                    eprintln!("fake_vmm: MISMATCH at file offset {:#x}", off + at as u64);
                                }
                            } else if got.iter().all(|&b| b == 0) {
                                c.zero.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                    if c.checked.fetch_add(1, Ordering::SeqCst) == 0 {
                        let _ = c.first_touch_unix_us.compare_exchange(0, unix_us(), Ordering::SeqCst, Ordering::SeqCst);
                    }
                }
                lat.lock().expect("latency lock").extend(mine);
                data_lat.lock().expect("latency lock").extend(mine_data);
                chunks.lock().expect("chunks lock").extend(mine_chunks);
                Ok(())
            }));
        }
        for h in handles {
            h.join().map_err(|_| anyhow::anyhow!("a touch thread panicked"))??;
        }
    }
    let seconds = start.elapsed().as_secs_f64();

    let mut dontneed_nonzero = 0u64;
    let mut dontneed_pages = 0u64;
    if let Some((off, len)) = dontneed {
        let addr = guest_addr(&regions, off).expect("checked above");
        // SAFETY: the range lies inside one of our private anonymous regions, and no thread
        // holds references into it (all reads go through process_vm_readv copies).
        let rc = unsafe { libc::madvise(addr as *mut libc::c_void, len as usize, libc::MADV_DONTNEED) };
        ensure!(rc == 0, "madvise(MADV_DONTNEED): {}", std::io::Error::last_os_error());
        let mut got = vec![0u8; PAGE as usize];
        for p in 0..len / PAGE {
            dontneed_pages += 1;
            match read_guest_page(addr + p * PAGE, &mut got) {
                Read::Ok if got.iter().all(|&b| b == 0) => {}
                Read::Ok => {
                    if dontneed_nonzero < 5 {
                        eprintln!("fake_vmm: removed page at file offset {:#x} came back non-zero", off + p * PAGE);
                    }
                    dontneed_nonzero += 1;
                }
                Read::Poisoned(_) => {
                    counters.poisoned.fetch_add(1, Ordering::SeqCst);
                }
            }
        }
        counters.mismatches.fetch_add(dontneed_nonzero, Ordering::SeqCst);
    }

    let mut lat = std::mem::take(&mut *latencies.lock().expect("latency lock"));
    lat.sort_unstable();
    let data = std::mem::take(&mut *data_latencies.lock().expect("latency lock"));
    let mut data_lat: Vec<u64> = data.iter().map(|&(t, _)| t).collect();
    data_lat.sort_unstable();
    let mut fault_lat: Vec<u64> = data.iter().filter(|&&(_, missing)| missing).map(|&(t, _)| t).collect();
    fault_lat.sort_unstable();
    let c = &counters;
    let (checked, mismatches, poisoned, zero) =
        (c.checked.load(Ordering::SeqCst), c.mismatches.load(Ordering::SeqCst), c.poisoned.load(Ordering::SeqCst), c.zero.load(Ordering::SeqCst));
    let data_chunks_touched = {
        let mut v = std::mem::take(&mut *data_chunks.lock().expect("chunks lock"));
        v.sort_unstable();
        v.dedup();
        v.len()
    };
    let summary = serde_json::json!({
        "pages_checked": checked,
        "mismatches": mismatches,
        "poisoned": poisoned,
        "zero_pages_seen": zero,
        "seconds": seconds,
        "touch_latency_us": {
            "p50": percentile(&lat, 0.50),
            "p99": percentile(&lat, 0.99),
            "max": percentile(&lat, 1.0),
        },
        "touch_latency_us_data": {
            "pages": data_lat.len(),
            "p50": percentile(&data_lat, 0.50),
            "p99": percentile(&data_lat, 0.99),
            "max": percentile(&data_lat, 1.0),
        },
        // Of those, the touches that found their page missing: the vCPU's fault latency.
        "fault_latency_us_data": {
            "pages": fault_lat.len(),
            "p50": percentile(&fault_lat, 0.50),
            "p99": percentile(&fault_lat, 0.99),
            "max": percentile(&fault_lat, 1.0),
        },
        "pages_missing_at_touch": c.missing.load(Ordering::SeqCst),
        // Distinct 1 MiB units of the file holding a data page touched: a lazy restore's
        // least fetches (bench/wan.sh's latency floor).
        "data_chunks_touched": data_chunks_touched,
        // Microseconds since the Unix epoch: connected to the handler's socket, handshake
        // sent, first touch returned.
        "connected_unix_us": connected_unix_us,
        "handshake_unix_us": handshake_unix_us,
        "first_touch_unix_us": c.first_touch_unix_us.load(Ordering::SeqCst),
        "dontneed_pages": dontneed_pages,
        "dontneed_nonzero": dontneed_nonzero,
        "threads": a.threads,
        "page_size": page,
        "regions": regions.iter().map(|r| serde_json::json!({"base": r.base, "size": r.size, "offset": r.offset})).collect::<Vec<_>>(),
        "stalled": false,
    });
    if a.json {
        println!("{summary}");
    }
    eprintln!(
        "fake_vmm: {checked} pages checked in {seconds:.3} s: {mismatches} mismatches, {poisoned} poisoned, {zero} zero; first-touch p50 {:.1} us, p99 {:.1} us",
        percentile(&lat, 0.5),
        percentile(&lat, 0.99)
    );
    // The socket closes on exit: that is how the handler learns this "VM" is gone.
    drop(sock);
    Ok(if mismatches > 0 {
        1
    } else if poisoned > 0 {
        3
    } else {
        0
    })
}

/// Connect to the handler's socket, waiting briefly for it to appear (a handler that is
/// still starting is normal; one that never listens is an error).
fn connect(path: &std::path::Path) -> anyhow::Result<UnixStream> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match UnixStream::connect(path) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() < deadline && matches!(e.kind(), std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused) => {
                // Short: the benchmarks take the connect as the moment the handler was ready.
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(e).with_context(|| format!("connect to {}", path.display())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn regions(ranges: &[(u64, u64)]) -> Vec<Region> {
        ranges.iter().map(|&(offset, size)| Region { base: 0x1000_0000 + offset * 2, size, offset }).collect()
    }

    #[test]
    fn regions_split_the_file_and_reject_bad_specs() {
        assert_eq!(plan_regions("2", 16 << 20, PAGE).unwrap(), vec![(0, 8 << 20), (8 << 20, 8 << 20)]);
        // An odd page count: the last region takes the rest; a partial last page is rounded up.
        assert_eq!(plan_regions("2", 3 * PAGE + 10, PAGE).unwrap(), vec![(0, 2 * PAGE), (2 * PAGE, 2 * PAGE)]);
        assert_eq!(plan_regions("0:1MiB,2MiB:1MiB", 4 << 20, PAGE).unwrap(), vec![(0, 1 << 20), (2 << 20, 1 << 20)]);
        assert!(plan_regions("0:1MiB,3MiB:2MiB", 4 << 20, PAGE).is_err(), "past the end");
        assert!(plan_regions("0:100", 4 << 20, PAGE).is_err(), "not whole pages");
        assert!(plan_regions("0", 4 << 20, PAGE).is_err());
        assert!(plan_regions("2", 0, PAGE).is_err());
        // Huge pages: regions are whole 2 MiB pages (3 of them: 2 + the rest).
        assert_eq!(plan_regions("2", 6 << 20, HUGE_PAGE).unwrap(), vec![(0, 2 << 20), (2 << 20, 4 << 20)]);
        assert!(plan_regions("0:1MiB", 4 << 20, HUGE_PAGE).is_err(), "half a huge page");
        assert!(plan_regions("1MiB:2MiB", 4 << 20, HUGE_PAGE).is_err(), "not huge-page aligned");
    }

    #[test]
    fn touch_plans_cover_what_they_say() {
        let r = regions(&[(0, 64 * PAGE), (64 * PAGE, 64 * PAGE)]);
        let mut all = plan_touches("all", &r, 1, 1).unwrap();
        assert_ne!(all, (0..128).collect::<Vec<_>>(), "random order");
        all.sort_unstable();
        assert_eq!(all, (0..128).collect::<Vec<_>>());
        assert_eq!(plan_touches("all", &r, 5, 1).unwrap(), plan_touches("all", &r, 5, 1).unwrap(), "same seed, same order");

        let scattered = plan_touches("25%", &r, 2, 1).unwrap();
        assert_eq!(scattered.len(), 32);
        let mut runs = plan_touches("25%", &r, 2, 8).unwrap();
        assert_eq!(runs.len(), 32);
        runs.sort_unstable();
        runs.dedup();
        assert_eq!(runs.len(), 32, "no page twice");
        // Runs of 8: far fewer separate extents than 32 scattered pages would give.
        let extents = runs.windows(2).filter(|w| w[1] != w[0] + 1).count() + 1;
        assert!(extents <= 8, "{extents} extents: {runs:?}");

        assert_eq!(plan_touches("3,5-7", &r, 1, 1).unwrap(), vec![3, 5, 6, 7]);
        assert!(plan_touches("200", &r, 1, 1).is_err(), "page outside every region");
        assert!(plan_touches("0%", &r, 1, 1).is_err());
    }
}
