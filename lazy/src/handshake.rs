//! The runtime's handshake: Firecracker's UFFD protocol.
//!
//! A restoring VMM connects to the daemon's Unix socket and sends **one** message: a JSON
//! array of `GuestRegionUffdMapping`s (one per guest memory region) with its userfaultfd
//! attached as `SCM_RIGHTS`. The peer's pid comes from `SO_PEERCRED`.
//!
//! ```text
//! [{"base_host_virt_addr": 140..., "size": 134217728, "offset": 0,
//!   "page_size": 4096, "page_size_kib": 4096}, ...]   + SCM_RIGHTS [uffd]
//! ```
//!
//! `page_size_kib` is Firecracker's older name for the same value, which despite its name
//! has always been in bytes; `page_size` wins when both are present. A region's page size
//! is 4096, or 2097152 for guest memory backed by 2 MiB huge pages (hugetlbfs): such a
//! region faults and is filled a whole huge page at a time ([`PAGE_SIZES`]).

use std::io::{IoSliceMut, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use nix::sys::socket::{getsockopt, recvmsg, sockopt, ControlMessageOwned, MsgFlags};
use serde::Deserialize;

/// Largest handshake message: a VMM has a handful of regions, so 64 KiB is generous and
/// bounds what a confused client can make us buffer.
pub const MAX_HANDSHAKE_BYTES: usize = 64 << 10;
/// Most regions one connection may register.
pub const MAX_REGIONS: usize = 1024;
/// The base page size: a region of ordinary (4 KiB) pages.
pub const BASE_PAGE_SIZE: u64 = 4096;
/// A region backed by 2 MiB huge pages (hugetlbfs): faults come and installs go a whole
/// huge page at a time.
pub const HUGE_PAGE_SIZE: u64 = 2 << 20;
/// The page sizes a region may have: Firecracker's two (no hugepages, or `2M` hugetlbfs).
/// Anything else is refused at the handshake rather than met at the first fault, where an
/// install of the wrong size fails and leaves the vCPU stalled. 1 GiB pages are not
/// served: every install would hold a whole gigabyte of verified bytes at once.
pub const PAGE_SIZES: [u64; 2] = [BASE_PAGE_SIZE, HUGE_PAGE_SIZE];
/// Largest page size accepted.
pub const MAX_PAGE_SIZE: u64 = HUGE_PAGE_SIZE;
/// How long a connected client may take to send its handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a handshake was refused. The daemon logs it and closes that connection only.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
#[non_exhaustive]
pub enum HandshakeError {
    /// handshake: reading the socket failed: {0}
    Io(std::io::Error),
    /// handshake: the peer closed the connection before sending its regions
    Closed,
    /// handshake: message larger than 64 KiB
    TooLarge,
    /// handshake: no userfaultfd attached (SCM_RIGHTS)
    NoFd,
    /// handshake: regions are not valid JSON: {0}
    Json(serde_json::Error),
    /// handshake: region {index}: {detail}
    BadRegion { index: usize, detail: String },
    /// handshake: no regions
    NoRegions,
    /// handshake: {0} regions (at most 1024)
    TooManyRegions(usize),
}

/// One region as the VMM sends it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct GuestRegionUffdMapping {
    pub base_host_virt_addr: u64,
    pub size: u64,
    /// Offset of the region in the memory file.
    pub offset: u64,
    #[serde(default)]
    pub page_size: Option<u64>,
    #[serde(default)]
    pub page_size_kib: Option<u64>,
}

/// A checked region: page-aligned, inside the memory file, not overlapping another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    /// Host virtual address of the region's first byte in the VMM.
    pub base: u64,
    pub size: u64,
    /// Offset of `base` in the memory file.
    pub offset: u64,
    /// Bytes; a power of two (4 KiB, or a huge page size).
    pub page_size: u64,
}

impl Region {
    pub fn end(&self) -> u64 {
        self.base + self.size
    }
    pub fn contains(&self, addr: u64) -> bool {
        addr >= self.base && addr < self.end()
    }
}

/// Parse and check the JSON array against the memory file's size: every region must lie
/// inside the file, be aligned to its page size and not overlap another region.
pub fn parse_regions(json: &[u8], file_size: u64) -> Result<Vec<Region>, HandshakeError> {
    if json.len() > MAX_HANDSHAKE_BYTES {
        return Err(HandshakeError::TooLarge);
    }
    let raw: Vec<GuestRegionUffdMapping> = serde_json::from_slice(json).map_err(HandshakeError::Json)?;
    if raw.is_empty() {
        return Err(HandshakeError::NoRegions);
    }
    if raw.len() > MAX_REGIONS {
        return Err(HandshakeError::TooManyRegions(raw.len()));
    }
    let mut out = Vec::with_capacity(raw.len());
    for (index, m) in raw.iter().enumerate() {
        let bad = |detail: String| HandshakeError::BadRegion { index, detail };
        let page_size = m.page_size.or(m.page_size_kib).ok_or_else(|| bad("no page_size".into()))?;
        if !PAGE_SIZES.contains(&page_size) {
            return Err(bad(format!("page size {page_size} is not served (only {BASE_PAGE_SIZE}: 4 KiB pages, or {HUGE_PAGE_SIZE}: 2 MiB huge pages)")));
        }
        if m.size == 0 {
            return Err(bad("size 0".into()));
        }
        for (what, v) in [("base_host_virt_addr", m.base_host_virt_addr), ("size", m.size), ("offset", m.offset)] {
            if v % page_size != 0 {
                return Err(bad(format!("{what} {v:#x} is not a multiple of the page size {page_size}")));
            }
        }
        if m.base_host_virt_addr.checked_add(m.size).is_none() {
            return Err(bad("address range wraps".into()));
        }
        match m.offset.checked_add(m.size) {
            Some(end) if end <= file_size => {}
            _ => return Err(bad(format!("file range {}+{} exceeds the memory file ({file_size} bytes)", m.offset, m.size))),
        }
        out.push(Region { base: m.base_host_virt_addr, size: m.size, offset: m.offset, page_size });
    }
    out.sort_by_key(|r| r.base);
    for w in out.windows(2) {
        if w[0].end() > w[1].base {
            let index = raw.iter().position(|m| m.base_host_virt_addr == w[1].base).unwrap_or(0);
            return Err(HandshakeError::BadRegion { index, detail: format!("overlaps the region at {:#x}", w[0].base) });
        }
    }
    Ok(out)
}

/// What one connection sent.
#[derive(Debug)]
pub struct Handshake {
    pub pid: i32,
    pub uffd: OwnedFd,
    /// The JSON text (not yet parsed: the caller checks it against the memory file).
    pub json: Vec<u8>,
}

/// Receive the handshake message from a freshly accepted connection.
///
/// The fd arrives with the first bytes; the JSON may in principle span several reads of a
/// stream socket, so reading continues until it parses or the size limit is hit.
pub fn receive(stream: &mut UnixStream) -> Result<Handshake, HandshakeError> {
    stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT)).map_err(HandshakeError::Io)?;
    let pid = getsockopt(&*stream, sockopt::PeerCredentials).map(|c| c.pid()).unwrap_or(0);
    let mut buf = vec![0u8; MAX_HANDSHAKE_BYTES];
    let mut fds: Vec<OwnedFd> = Vec::new();
    let n = {
        let mut iov = [IoSliceMut::new(&mut buf)];
        let mut space = nix::cmsg_space!([RawFd; 8]);
        let msg = recvmsg::<()>(stream.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC).map_err(|e| HandshakeError::Io(e.into()))?;
        for c in msg.cmsgs().map_err(|e| HandshakeError::Io(e.into()))? {
            if let ControlMessageOwned::ScmRights(received) = c {
                // SAFETY: the kernel just installed these descriptors in our table for us;
                // nothing else owns them, so each is wrapped exactly once (and closed on drop).
                fds.extend(received.into_iter().map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }));
            }
        }
        msg.bytes
    };
    if n == 0 && fds.is_empty() {
        return Err(HandshakeError::Closed);
    }
    let mut json = buf[..n].to_vec();
    // Keep reading only while the text is an incomplete JSON value.
    while is_incomplete(&json) {
        if json.len() >= MAX_HANDSHAKE_BYTES {
            return Err(HandshakeError::TooLarge);
        }
        let mut more = [0u8; 4096];
        let k = stream.read(&mut more).map_err(HandshakeError::Io)?;
        if k == 0 {
            break;
        }
        json.extend_from_slice(&more[..k]);
    }
    stream.set_read_timeout(None).map_err(HandshakeError::Io)?;
    // The first descriptor is the userfaultfd; any others are dropped (closed).
    let uffd = if fds.is_empty() { return Err(HandshakeError::NoFd) } else { fds.swap_remove(0) };
    Ok(Handshake { pid, uffd, json })
}

fn is_incomplete(json: &[u8]) -> bool {
    match serde_json::from_slice::<serde_json::Value>(json) {
        Err(e) => e.is_eof(),
        Ok(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn region_json(base: u64, size: u64, offset: u64) -> String {
        format!(r#"{{"base_host_virt_addr":{base},"size":{size},"offset":{offset},"page_size":4096,"page_size_kib":4096}}"#)
    }

    #[test]
    fn parses_firecracker_regions_with_a_gap() {
        // Two regions as on x86 above 3 GiB: the second starts later in the address space
        // but right after the first in the file.
        let j = format!("[{},{}]", region_json(0x7f00_0000_0000, 3 * MIB, 0), region_json(0x7f00_1000_0000, MIB, 3 * MIB));
        let r = parse_regions(j.as_bytes(), 4 * MIB).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!(r[1], Region { base: 0x7f00_1000_0000, size: MIB, offset: 3 * MIB, page_size: 4096 });
    }

    #[test]
    fn huge_page_regions_are_accepted_with_their_page_size() {
        // Firecracker with `"huge_pages": "2M"`: both fields say 2 MiB, in bytes.
        let j = format!(
            r#"[{{"base_host_virt_addr":{},"size":{},"offset":{},"page_size":2097152,"page_size_kib":2097152}}]"#,
            0x7f00_0020_0000u64,
            4 * MIB,
            2 * MIB
        );
        let r = parse_regions(j.as_bytes(), 6 * MIB).unwrap();
        assert_eq!(r, vec![Region { base: 0x7f00_0020_0000, size: 4 * MIB, offset: 2 * MIB, page_size: HUGE_PAGE_SIZE }]);
        // The older field alone carries it too.
        let j = format!(r#"[{{"base_host_virt_addr":{},"size":{},"offset":0,"page_size_kib":2097152}}]"#, 2 * MIB, 2 * MIB);
        assert_eq!(parse_regions(j.as_bytes(), 2 * MIB).unwrap()[0].page_size, HUGE_PAGE_SIZE);
    }

    #[test]
    fn old_field_name_is_bytes_too() {
        let j = r#"[{"base_host_virt_addr":4096,"size":8192,"offset":0,"page_size_kib":4096}]"#;
        assert_eq!(parse_regions(j.as_bytes(), 8192).unwrap()[0].page_size, 4096);
    }

    #[test]
    fn refuses_bad_input() {
        let cases: Vec<(String, &str)> = vec![
            ("not json".into(), "not valid JSON"),
            ("[]".into(), "no regions"),
            (r#"{"base_host_virt_addr":0}"#.into(), "not valid JSON"),
            (format!("[{}]", region_json(4096, 2 * MIB, 3 * MIB)), "exceeds the memory file"),
            (format!("[{}]", region_json(4096, MIB, u64::MAX - 4095)), "exceeds the memory file"),
            (format!("[{}]", region_json(100, MIB, 0)), "not a multiple of the page size"),
            (format!("[{}]", region_json(4096, 0, 0)), "size 0"),
            (format!("[{},{}]", region_json(0x10000, MIB, 0), region_json(0x20000, MIB, MIB)), "overlaps"),
            (r#"[{"base_host_virt_addr":4096,"size":4096,"offset":0,"page_size":3000}]"#.into(), "page size 3000 is not served"),
            // Powers of two that are not a page size served here: 64 KiB, 1 GiB huge pages.
            (r#"[{"base_host_virt_addr":0,"size":65536,"offset":0,"page_size":65536}]"#.into(), "page size 65536 is not served"),
            (r#"[{"base_host_virt_addr":0,"size":1073741824,"offset":0,"page_size":1073741824}]"#.into(), "page size 1073741824 is not served"),
            (r#"[{"base_host_virt_addr":0,"size":4096,"offset":0,"page_size":0}]"#.into(), "page size 0 is not served"),
            // A huge-page region must be huge-page aligned in the address space and the file.
            (
                format!(r#"[{{"base_host_virt_addr":{},"size":{},"offset":0,"page_size":{}}}]"#, 2 * MIB + 4096, 2 * MIB, 2 * MIB),
                "not a multiple of the page size",
            ),
            (
                format!(r#"[{{"base_host_virt_addr":{},"size":{},"offset":{},"page_size":{}}}]"#, 2 * MIB, 2 * MIB, MIB, 2 * MIB),
                "offset 0x100000 is not a multiple",
            ),
            (format!(r#"[{{"base_host_virt_addr":{},"size":{},"offset":0,"page_size":{}}}]"#, 2 * MIB, 3 * MIB, 2 * MIB), "size 0x300000 is not a multiple"),
            (r#"[{"base_host_virt_addr":4096,"size":4096,"offset":0}]"#.into(), "no page_size"),
            (r#"[{"base_host_virt_addr":-1,"size":4096,"offset":0,"page_size":4096}]"#.into(), "not valid JSON"),
        ];
        for (j, want) in cases {
            let e = parse_regions(j.as_bytes(), 4 * MIB).unwrap_err().to_string();
            assert!(e.contains(want), "{j}: {e}");
        }
        let big = vec![b' '; MAX_HANDSHAKE_BYTES + 1];
        assert!(matches!(parse_regions(&big, MIB), Err(HandshakeError::TooLarge)));
    }

    #[test]
    fn receives_fd_json_and_pid_over_a_socketpair() {
        use nix::sys::socket::{sendmsg, ControlMessage};
        use std::io::IoSlice;
        let (mut a, b) = UnixStream::pair().unwrap();
        let file = tempfile::tempfile().unwrap();
        let j = format!("[{}]", region_json(4096, 4096, 0));
        // Split the JSON over two writes: the fd rides with the first.
        let (p1, p2) = j.as_bytes().split_at(10);
        let fds = [file.as_raw_fd()];
        sendmsg::<()>(b.as_raw_fd(), &[IoSlice::new(p1)], &[ControlMessage::ScmRights(&fds)], MsgFlags::empty(), None).unwrap();
        (&b).write_all_compat(p2);
        let h = receive(&mut a).unwrap();
        assert_eq!(h.json, j.as_bytes());
        assert_eq!(h.pid, std::process::id() as i32);
        assert_ne!(h.uffd.as_raw_fd(), file.as_raw_fd());
        assert_eq!(parse_regions(&h.json, 4096).unwrap().len(), 1);
    }

    #[test]
    fn no_fd_and_closed_peer_are_errors() {
        let (mut a, b) = UnixStream::pair().unwrap();
        (&b).write_all_compat(b"[]");
        drop(b);
        assert!(matches!(receive(&mut a), Err(HandshakeError::NoFd)));
        let (mut a, b) = UnixStream::pair().unwrap();
        drop(b);
        assert!(matches!(receive(&mut a), Err(HandshakeError::Closed)));
    }

    trait WriteAllCompat {
        fn write_all_compat(self, b: &[u8]);
    }
    impl WriteAllCompat for &UnixStream {
        fn write_all_compat(mut self, b: &[u8]) {
            std::io::Write::write_all(&mut self, b).unwrap();
        }
    }
}
