//! Two page-cache helpers shared by everything that reads blob and source files: start a
//! range coming in from disk ahead of use, and map a range so its bytes can be handed on
//! (sent, sliced) without a copy.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

/// Ask the kernel to start reading `[offset, offset + len)` of `file` into the page cache
/// (`POSIX_FADV_WILLNEED`, asynchronous). A hint: failure changes nothing but speed.
pub fn will_need(file: &File, offset: u64, len: u64) {
    let (Ok(off), Ok(len)) = (libc::off_t::try_from(offset), libc::off_t::try_from(len)) else { return };
    // SAFETY: posix_fadvise only reads its integer arguments; the fd is borrowed from `file`
    // and stays open for the call.
    let _ = unsafe { libc::posix_fadvise(file.as_raw_fd(), off, len, libc::POSIX_FADV_WILLNEED) };
}

/// `len` bytes of `file` from `offset`, mapped and faulted in, as a buffer that unmaps when
/// its last slice is dropped.
///
/// Only for files that are never written in place or truncated while mapped: content-
/// addressed blobs, written under a temporary name and renamed into place complete (a
/// file deleted meanwhile stays mapped). The caller checks the range against the file's
/// size first.
pub fn map_range(file: &File, offset: u64, len: usize) -> io::Result<bytes::Bytes> {
    // SAFETY: the callers' contract above: the file's bytes in this range neither change
    // nor go away while mapped, and the range lies within the file.
    let map = unsafe { memmap2::MmapOptions::new().offset(offset).len(len).populate().map(file)? };
    Ok(bytes::Bytes::from_owner(map))
}
