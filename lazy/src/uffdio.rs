//! The three ioctls that fill a process's registered memory: `UFFDIO_COPY` (verified bytes),
//! `UFFDIO_ZEROPAGE` (zeros) and `UFFDIO_POISON` (no verified bytes exist), and the rules for
//! their partial results. Nothing here decides *what* goes where: that is
//! [`crate::install`]'s job; this is the kernel's side of it.
//!
//! ```text
//! fill(op, dst, len, page):  ioctl over [dst, dst+len)
//!   EEXIST  (a page is present)          -> skip that page, go on
//!   EAGAIN  with progress                -> go on from there; without: Fill::Again
//!   ENOENT  over more than one page      -> page by page (a range across VMAs), unmapped skipped
//!   ESRCH                                -> Fill::Gone (the process exited)
//! ```

use std::os::fd::AsRawFd;

use nix::errno::Errno;
use userfaultfd::Uffd;

// The three filling ioctls, called directly: the `userfaultfd` crate folds the byte
// count of a partial operation into its error for ZEROPAGE and reads a negative count as
// a huge one for COPY, and it has no POISON (Linux 6.6). Layouts from
// include/uapi/linux/userfaultfd.h.
#[repr(C)]
struct UffdioRange {
    start: u64,
    len: u64,
}
#[repr(C)]
struct UffdioCopy {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    copy: i64,
}
#[repr(C)]
struct UffdioZeropage {
    range: UffdioRange,
    mode: u64,
    zeropage: i64,
}
#[repr(C)]
struct UffdioPoison {
    range: UffdioRange,
    mode: u64,
    updated: i64,
}
const UFFDIO: u8 = 0xAA;
nix::ioctl_readwrite!(ioctl_copy, UFFDIO, 0x03, UffdioCopy);
nix::ioctl_readwrite!(ioctl_zeropage, UFFDIO, 0x04, UffdioZeropage);
nix::ioctl_readwrite!(ioctl_poison, UFFDIO, 0x08, UffdioPoison);

/// How filling a range went wrong.
#[derive(Debug)]
pub(crate) enum Fill {
    /// The process's address space is changing (a remove event is pending): read events,
    /// then retry.
    Again,
    /// The process's memory is gone (it exited).
    Gone,
    /// The range is no longer registered (unmapped); nothing to fill.
    Unmapped,
    /// Anything else: a bug or an unsupported operation.
    Failed(Errno),
}

/// What to fill a range with.
#[derive(Clone, Copy)]
pub(crate) enum Op<'a> {
    /// These bytes (verified by the caller), as long as the range.
    Copy(&'a [u8]),
    Zero,
    Poison,
}

/// One process's userfaultfd, for filling.
pub(crate) struct Uffdio {
    uffd: Uffd,
    sys_page: u64,
}

/// One ioctl over `[dst, dst + len)`: its result and the kernel's count of bytes done.
fn fill_ioctl(fd: i32, op: Op, dst: u64, len: u64) -> (Result<(), Errno>, i64) {
    // SAFETY: each struct is the kernel's layout for its ioctl number and lives across the
    // call; `src` of a copy points at `len` readable bytes of a live slice (checked by the
    // caller), and the destination is in the *peer's* address space, which the kernel checks
    // against the registered ranges.
    unsafe {
        match op {
            Op::Copy(b) => {
                let mut a = UffdioCopy { dst, src: b.as_ptr() as u64, len, mode: 0, copy: 0 };
                let r = ioctl_copy(fd, &mut a).map(|_| ());
                (r, a.copy)
            }
            Op::Zero => {
                let mut a = UffdioZeropage { range: UffdioRange { start: dst, len }, mode: 0, zeropage: 0 };
                let r = ioctl_zeropage(fd, &mut a).map(|_| ());
                (r, a.zeropage)
            }
            Op::Poison => {
                let mut a = UffdioPoison { range: UffdioRange { start: dst, len }, mode: 0, updated: 0 };
                let r = ioctl_poison(fd, &mut a).map(|_| ());
                (r, a.updated)
            }
        }
    }
}

impl Uffdio {
    pub fn new(uffd: Uffd) -> Uffdio {
        // SAFETY: sysconf has no preconditions.
        let sys_page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u64;
        Uffdio { uffd, sys_page }
    }

    /// The descriptor, for reading events and waking.
    pub fn uffd(&self) -> &Uffd {
        &self.uffd
    }

    /// The system's base page size.
    pub fn sys_page(&self) -> u64 {
        self.sys_page
    }

    /// Wake the threads waiting on `[addr, addr + len)` (pages filled by someone else were
    /// not woken by our ioctls).
    pub fn wake(&self, addr: u64, len: u64) {
        let _ = self.uffd.wake(addr as *mut libc::c_void, len as usize);
    }

    /// One ioctl and nothing more (no retry, no page-by-page): the probe of a page that is
    /// most likely present.
    pub fn try_once(&self, op: Op, dst: u64, len: u64) -> Result<(), Errno> {
        fill_ioctl(self.uffd.as_raw_fd(), op, dst, len).0
    }

    /// Fill `[dst, dst + len)` page by page where needed: pages already present (EEXIST)
    /// are skipped, partial progress is kept.
    pub fn fill(&self, op: Op, dst: u64, len: u64, page: u64) -> Result<(), Fill> {
        let fd = self.uffd.as_raw_fd();
        let mut off = 0u64;
        while off < len {
            let op_here = match op {
                Op::Copy(b) => Op::Copy(&b[off as usize..len as usize]),
                o => o,
            };
            let (r, count) = fill_ioctl(fd, op_here, dst + off, len - off);
            match r {
                Ok(()) => off = len,
                Err(Errno::EAGAIN) if count > 0 && (count as u64) <= len - off => off += count as u64,
                Err(Errno::EAGAIN) => return Err(Fill::Again),
                Err(Errno::EEXIST) => off += page,
                Err(Errno::ESRCH) => return Err(Fill::Gone),
                // One ioctl must stay inside one VMA: a range over a VMA boundary (a CRIU
                // pagemap entry may cover adjacent VMAs) fails as a whole, so retry it page
                // by page and skip only the pages that really are unmapped.
                Err(Errno::ENOENT) if len - off > page => return self.fill_pages(op, dst + off, len - off, page, off),
                Err(Errno::ENOENT) => return Err(Fill::Unmapped),
                Err(e) => return Err(Fill::Failed(e)),
            }
        }
        Ok(())
    }

    /// `fill` one page at a time (`skip`: bytes of `op`'s data before `dst`).
    fn fill_pages(&self, op: Op, dst: u64, len: u64, page: u64, skip: u64) -> Result<(), Fill> {
        let mut mapped = false;
        for p in (0..len).step_by(page as usize) {
            let op_here = match op {
                Op::Copy(b) => Op::Copy(&b[(skip + p) as usize..(skip + p + page) as usize]),
                o => o,
            };
            match self.fill(op_here, dst + p, page, page) {
                Ok(()) => mapped = true,
                Err(Fill::Unmapped) => {}
                Err(e) => return Err(e),
            }
        }
        if mapped {
            Ok(())
        } else {
            Err(Fill::Unmapped)
        }
    }

    /// Fill `[a, b)` with zeros: one UFFDIO_ZEROPAGE, or a copy of zeros page by page for
    /// huge pages (which have no zero page).
    pub fn fill_zeros(&self, a: u64, b: u64, page: u64) -> Result<(), Fill> {
        match self.zero_op(page) {
            Op::Copy(z) => (a..b).step_by(page as usize).try_for_each(|p| self.fill(Op::Copy(z), p, page, page)),
            op => self.fill(op, a, b - a, page),
        }
    }

    /// How a page of `page` bytes is zeroed.
    pub fn zero_op(&self, page: u64) -> Op<'static> {
        // UFFDIO_ZEROPAGE maps the shared zero page; it does not exist for huge pages.
        if page <= self.sys_page {
            Op::Zero
        } else {
            Op::Copy(zeros(page))
        }
    }
}

/// A page of zeros at least `len` long (huge pages have no UFFDIO_ZEROPAGE).
fn zeros(len: u64) -> &'static [u8] {
    static Z: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    let z = Z.get_or_init(|| vec![0u8; crate::handshake::MAX_PAGE_SIZE as usize]);
    &z[..len as usize]
}
