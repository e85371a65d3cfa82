//! Page-cache helpers shared by everything that reads and writes blob, source and pulled
//! files: start a range coming in from disk ahead of use, start a written range going out
//! to disk ahead of the fsync, and map a range so its bytes can be handed on (sent,
//! sliced) without a copy.

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

/// Start writing `[offset, offset + len)` of `file` to disk without waiting for it
/// (`sync_file_range(SYNC_FILE_RANGE_WRITE)`), so the disk works while the caller goes on
/// and a later fsync finds little left to do (`len` 0: to the end of the file). A hint,
/// not durability: if it fails, the fsync does the work.
pub fn start_writeback(file: &File, offset: u64, len: u64) {
    let (Ok(off), Ok(n)) = (libc::off64_t::try_from(offset), libc::off64_t::try_from(len)) else { return };
    // SAFETY: sync_file_range only reads its integer arguments; the fd is borrowed from
    // `file` and stays open for the call.
    let _ = unsafe { libc::sync_file_range(file.as_raw_fd(), off, n, libc::SYNC_FILE_RANGE_WRITE) };
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
