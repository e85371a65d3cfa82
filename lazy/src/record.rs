//! What a recording restore (`--record-trace`) keeps while it serves the guest: the chunks
//! in the order first needed for data, the working set by slice with its bytes, and the
//! zero chunks touched; made into a [`Trace`] and its working-set blob when the
//! connection ends. The installer records as it installs ([`crate::install`]).

use std::collections::HashSet;

use crate::trace::{Trace, WORKING_SET_MEDIA_TYPE};

/// Numbers in the order first added, each once.
#[derive(Default)]
pub(crate) struct FirstSeen {
    seen: HashSet<u64>,
    order: Vec<u64>,
}

impl FirstSeen {
    /// Add `x`; true if it was not there yet.
    pub fn add(&mut self, x: u64) -> bool {
        let new = self.seen.insert(x);
        if new {
            self.order.push(x);
        }
        new
    }

    /// The numbers in first-added order, leaving this empty.
    pub fn take(&mut self) -> Vec<u64> {
        self.seen.clear();
        std::mem::take(&mut self.order)
    }
}

/// One connection's recording.
#[derive(Default)]
pub(crate) struct Recording {
    /// File chunks in the order first faulted for data.
    pub chunks: FirstSeen,
    /// File offsets of the slices whose pages the guest touched, first touch first ...
    pub working_set: FirstSeen,
    /// ... and their bytes in that order.
    pub working_set_bytes: Vec<u8>,
    /// Zero chunks the guest touched, first touch first.
    pub zero_chunks: FirstSeen,
}

impl Recording {
    /// Record the slice at file offset `at` (its bytes `bytes`) in the working set, once.
    pub fn slice(&mut self, at: u64, bytes: &[u8]) {
        if self.working_set.add(at) {
            self.working_set_bytes.extend_from_slice(bytes);
        }
    }

    /// The trace of file `file` (chunks of `chunk_size` bytes) and its working-set blob,
    /// leaving this empty.
    pub fn take_trace(&mut self, file: &str, chunk_size: u64) -> (Trace, Vec<u8>) {
        let mut t = Trace::new(file, chunk_size, self.chunks.take());
        t.working_set = self.working_set.take();
        t.zero_chunks = self.zero_chunks.take();
        let bytes = std::mem::take(&mut self.working_set_bytes);
        if !bytes.is_empty() {
            t.working_set_blob = Some(imgfmt::Descriptor::new(WORKING_SET_MEDIA_TYPE, imgfmt::OciDigest::of(&bytes), bytes.len() as u64));
        }
        (t, bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A recording keeps each chunk, slice and zero chunk once, in first-touch order, and
    /// the slices' bytes in the same order; taking it leaves it empty.
    #[test]
    fn a_recording_becomes_a_trace_in_first_touch_order() {
        let mut r = Recording::default();
        for c in [9, 0, 9, 20] {
            r.chunks.add(c);
        }
        r.slice(0x9d000, &[1; 4096]);
        r.slice(0xd000, &[2; 4096]);
        r.slice(0x9d000, &[3; 4096]);
        r.zero_chunks.add(1);
        r.zero_chunks.add(1);
        let (t, blob) = r.take_trace("vm.mem", 1 << 16);
        assert_eq!((t.chunks.as_slice(), t.working_set.as_slice(), t.zero_chunks.as_slice()), (&[9, 0, 20][..], &[0x9d000, 0xd000][..], &[1][..]));
        assert_eq!(blob.len(), 8192);
        assert!(blob[..4096].iter().all(|&b| b == 1) && blob[4096..].iter().all(|&b| b == 2));
        let d = t.working_set_blob.expect("a blob descriptor");
        assert_eq!((d.size, d.digest), (8192, imgfmt::OciDigest::of(&blob)));
        let (t, blob) = r.take_trace("vm.mem", 1 << 16);
        assert!(t.chunks.is_empty() && t.working_set.is_empty() && blob.is_empty() && t.working_set_blob.is_none());
    }
}
