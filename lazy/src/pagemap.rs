//! CRIU's `pagemap-<pid>.img`: which of a process's pages a dump holds and where their
//! bytes are in `pages-<id>.img`.
//!
//! ```text
//! u32 IMG_COMMON_MAGIC 0x54564319 | u32 PAGEMAP_MAGIC 0x56084025      (criu/include/magic.h)
//! u32 len | pagemap_head  { uint32 pages_id = 1; }                     (images/pagemap.proto)
//! u32 len | pagemap_entry { uint64 vaddr = 1; uint32 nr_pages = 2;
//!                           bool in_parent = 3; uint32 flags = 4; }    ... to the end
//! ```
//!
//! All integers little-endian (CRIU writes them native-endian; it only runs little-endian
//! here). `pages-<id>.img` is raw: the pages of the PE_PRESENT entries, back to back, in
//! pagemap order (criu/pagemap.c `skip_pagemap_pages` advances the pages-file offset only
//! for present entries).
//!
//! Protobuf is decoded by hand (varints and field tags, ~80 lines) rather than with
//! prost: two tiny messages do not justify a code generator and a build script, and this
//! file has no dependency beyond thiserror/displaydoc so the fuzz crate can build it
//! alone (`fuzz/fuzz_targets/criu_pagemap.rs`).
//!
//! This file is a decoder of untrusted bytes: every error is typed, nothing panics, and
//! allocation is bounded by the input's length.

/// `IMG_COMMON_MAGIC` (criu/include/magic.h): the first word of every non-inventory image.
pub const IMG_COMMON_MAGIC: u32 = 0x5456_4319;
/// `PAGEMAP_MAGIC` (criu/include/magic.h, "Vladimir").
pub const PAGEMAP_MAGIC: u32 = 0x5608_4025;
/// Pages are in the parent dump's images (`--prev-images-dir`).
pub const PE_PARENT: u32 = 1 << 0;
/// Pages may be restored lazily (through userfaultfd).
pub const PE_LAZY: u32 = 1 << 1;
/// Pages are in `pages-<id>.img`.
pub const PE_PRESENT: u32 = 1 << 2;
/// CRIU's page size on the platforms it dumps lazily (x86-64, arm64 with 4 KiB pages).
pub const PAGE_SIZE: u64 = 4096;
/// Largest pagemap image accepted (an entry is ~10-20 bytes: millions of entries).
pub const MAX_PAGEMAP_BYTES: usize = 64 << 20;
/// Largest single protobuf message: a pagemap entry is at most ~30 bytes; unknown fields
/// a newer CRIU may add get generous room, an absurd length is refused.
pub const MAX_MESSAGE_BYTES: u32 = 4096;
/// Highest user address + 1 on any 64-bit Linux (5-level paging: 2^57).
pub const MAX_VADDR: u64 = 1 << 57;

/// Why a pagemap image was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, displaydoc::Display)]
#[non_exhaustive]
pub enum PagemapError {
    /// pagemap: {0} bytes is larger than the 64 MiB limit
    TooLarge(usize),
    /// pagemap: truncated at byte {0}
    Truncated(usize),
    /// pagemap: image magic {0:#010x}, expected IMG_COMMON_MAGIC 0x54564319
    CommonMagic(u32),
    /// pagemap: magic {0:#010x}, expected PAGEMAP_MAGIC 0x56084025
    Magic(u32),
    /// pagemap: message at byte {at} claims {len} bytes (at most 4096)
    MessageTooLong { at: usize, len: u32 },
    /// pagemap: no pagemap_head
    NoHead,
    /// pagemap: message at byte {at}: {detail}
    Protobuf { at: usize, detail: String },
    /// pagemap: entry {index}: {detail}
    BadEntry { index: usize, detail: String },
}

/// One `pagemap_entry`, with CRIU's compatibility rule applied to `flags`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagemapEntry {
    pub vaddr: u64,
    pub nr_pages: u32,
    pub flags: u32,
}

impl PagemapEntry {
    pub fn len(&self) -> u64 {
        self.nr_pages as u64 * PAGE_SIZE
    }
    pub fn is_empty(&self) -> bool {
        self.nr_pages == 0
    }
    pub fn end(&self) -> u64 {
        self.vaddr + self.len()
    }
    pub fn present(&self) -> bool {
        self.flags & PE_PRESENT != 0
    }
    pub fn lazy(&self) -> bool {
        self.flags & PE_LAZY != 0
    }
    pub fn in_parent(&self) -> bool {
        self.flags & PE_PARENT != 0
    }
}

/// A decoded pagemap image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pagemap {
    /// The `<id>` of the `pages-<id>.img` holding the present entries' pages.
    pub pages_id: u32,
    /// Sorted by `vaddr`, non-overlapping (checked).
    pub entries: Vec<PagemapEntry>,
}

/// Where a present entry's pages are: `[vaddr, vaddr + len)` at `offset` in the pages file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagesRun {
    pub vaddr: u64,
    pub len: u64,
    pub offset: u64,
    pub lazy: bool,
}

impl Pagemap {
    /// The present entries with their offsets in `pages-<id>.img` (the offset advances
    /// only over present entries, as CRIU's `skip_pagemap_pages` does).
    pub fn runs(&self) -> Vec<PagesRun> {
        let mut off = 0u64;
        let mut out = Vec::new();
        for e in &self.entries {
            if e.present() {
                out.push(PagesRun { vaddr: e.vaddr, len: e.len(), offset: off, lazy: e.lazy() });
                off += e.len();
            }
        }
        out
    }

    /// Bytes of `pages-<id>.img` the entries need.
    pub fn pages_bytes(&self) -> u64 {
        self.entries.iter().filter(|e| e.present()).map(|e| e.len()).sum()
    }

    /// `[start, end)` ranges whose pages are in a parent dump.
    pub fn parent_ranges(&self) -> Vec<(u64, u64)> {
        self.entries.iter().filter(|e| e.in_parent()).map(|e| (e.vaddr, e.end())).collect()
    }
}

/// Encode a pagemap image (for tests and the fake CRIU runtime).
pub fn encode_pagemap(p: &Pagemap) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&IMG_COMMON_MAGIC.to_le_bytes());
    out.extend_from_slice(&PAGEMAP_MAGIC.to_le_bytes());
    let mut msg = Vec::new();
    put_field_varint(&mut msg, 1, p.pages_id as u64);
    put_message(&mut out, &msg);
    for e in &p.entries {
        msg.clear();
        put_field_varint(&mut msg, 1, e.vaddr);
        put_field_varint(&mut msg, 2, e.nr_pages as u64);
        put_field_varint(&mut msg, 4, e.flags as u64);
        put_message(&mut out, &msg);
    }
    out
}

fn put_message(out: &mut Vec<u8>, msg: &[u8]) {
    out.extend_from_slice(&(msg.len() as u32).to_le_bytes());
    out.extend_from_slice(msg);
}

fn put_field_varint(out: &mut Vec<u8>, field: u32, v: u64) {
    put_varint(out, (field as u64) << 3);
    put_varint(out, v);
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    loop {
        let b = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(b);
            return;
        }
        out.push(b | 0x80);
    }
}

/// Decode and check a pagemap image.
pub fn decode_pagemap(b: &[u8]) -> Result<Pagemap, PagemapError> {
    if b.len() > MAX_PAGEMAP_BYTES {
        return Err(PagemapError::TooLarge(b.len()));
    }
    let word = |at: usize| -> Result<u32, PagemapError> {
        let s = b.get(at..at + 4).ok_or(PagemapError::Truncated(b.len()))?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    };
    let m = word(0)?;
    if m != IMG_COMMON_MAGIC {
        return Err(PagemapError::CommonMagic(m));
    }
    let m = word(4)?;
    if m != PAGEMAP_MAGIC {
        return Err(PagemapError::Magic(m));
    }
    let mut at = 8usize;
    let mut head: Option<u32> = None;
    let mut entries: Vec<PagemapEntry> = Vec::new();
    while at < b.len() {
        let len = word(at)?;
        if len > MAX_MESSAGE_BYTES {
            return Err(PagemapError::MessageTooLong { at, len });
        }
        let body = b.get(at + 4..at + 4 + len as usize).ok_or(PagemapError::Truncated(b.len()))?;
        let fields = parse_message(body).map_err(|detail| PagemapError::Protobuf { at, detail })?;
        match head {
            None => {
                let id = fields.get(1).ok_or_else(|| PagemapError::Protobuf { at, detail: "pagemap_head without pages_id".into() })?;
                head = Some(u32::try_from(id).map_err(|_| PagemapError::Protobuf { at, detail: format!("pages_id {id} is not a uint32") })?);
            }
            Some(_) => {
                let index = entries.len();
                let bad = |detail: String| PagemapError::BadEntry { index, detail };
                let vaddr = fields.get(1).ok_or_else(|| bad("no vaddr".into()))?;
                let nr = fields.get(2).ok_or_else(|| bad("no nr_pages".into()))?;
                let nr_pages = u32::try_from(nr).map_err(|_| bad(format!("nr_pages {nr} is not a uint32")))?;
                // init_compat_pagemap_entry: an old image's in_parent means PE_PARENT; with
                // neither in_parent nor flags the entry is present.
                let mut flags = match fields.get(4) {
                    Some(f) => u32::try_from(f).map_err(|_| bad(format!("flags {f:#x} is not a uint32")))?,
                    None if fields.get(3).is_some_and(|p| p != 0) => 0,
                    None => PE_PRESENT,
                };
                if fields.get(3).is_some_and(|p| p != 0) {
                    flags |= PE_PARENT;
                }
                if flags & !(PE_PARENT | PE_LAZY | PE_PRESENT) != 0 {
                    // A flag this decoder does not know may change where pages are (a
                    // newer CRIU's layout): refuse rather than guess offsets.
                    return Err(bad(format!("unknown flags {flags:#x}")));
                }
                if flags & PE_PARENT != 0 && flags & PE_PRESENT != 0 {
                    return Err(bad("both PE_PARENT and PE_PRESENT".into()));
                }
                if vaddr % PAGE_SIZE != 0 {
                    return Err(bad(format!("vaddr {vaddr:#x} is not page-aligned")));
                }
                if nr_pages == 0 {
                    return Err(bad("nr_pages 0".into()));
                }
                let e = PagemapEntry { vaddr, nr_pages, flags };
                if vaddr >= MAX_VADDR || e.len() > MAX_VADDR - vaddr {
                    return Err(bad(format!("{vaddr:#x} + {nr_pages} pages is beyond the user address space")));
                }
                if let Some(prev) = entries.last() {
                    if prev.end() > vaddr {
                        return Err(bad(format!("{vaddr:#x} is not after the previous entry (ends {:#x})", prev.end())));
                    }
                }
                entries.push(e);
            }
        }
        at += 4 + len as usize;
    }
    let pages_id = head.ok_or(PagemapError::NoHead)?;
    Ok(Pagemap { pages_id, entries })
}

/// The varint fields 1..=4 of one message (the last occurrence wins, as in protobuf);
/// other fields are skipped by wire type.
#[derive(Default)]
struct Fields([Option<u64>; 5]);

impl Fields {
    fn get(&self, n: usize) -> Option<u64> {
        self.0[n]
    }
}

fn parse_message(mut b: &[u8]) -> Result<Fields, String> {
    let mut f = Fields::default();
    while !b.is_empty() {
        let key = varint(&mut b)?;
        let (field, wire) = (key >> 3, key & 7);
        if field == 0 {
            return Err("field number 0".into());
        }
        match wire {
            0 => {
                let v = varint(&mut b)?;
                if field <= 4 {
                    f.0[field as usize] = Some(v);
                }
            }
            1 | 5 => {
                let n = if wire == 1 { 8 } else { 4 };
                if field <= 4 {
                    return Err(format!("field {field} has wire type {wire}, expected a varint"));
                }
                b = b.get(n..).ok_or("truncated fixed-width field")?;
            }
            2 => {
                if field <= 4 {
                    return Err(format!("field {field} has wire type 2, expected a varint"));
                }
                let n = varint(&mut b)?;
                let n = usize::try_from(n).map_err(|_| "length overflows")?;
                b = b.get(n..).ok_or("truncated length-delimited field")?;
            }
            w => return Err(format!("unsupported wire type {w}")),
        }
    }
    Ok(f)
}

fn varint(b: &mut &[u8]) -> Result<u64, String> {
    let mut v = 0u64;
    for i in 0..10 {
        let (&byte, rest) = b.split_first().ok_or("truncated varint")?;
        *b = rest;
        if i == 9 && byte > 1 {
            return Err("varint overflows 64 bits".into());
        }
        v |= ((byte & 0x7f) as u64) << (7 * i);
        if byte & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err("varint longer than 10 bytes".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Pagemap {
        Pagemap {
            pages_id: 3,
            entries: vec![
                PagemapEntry { vaddr: 0x7e00_0000_0000, nr_pages: 4, flags: PE_PRESENT | PE_LAZY },
                PagemapEntry { vaddr: 0x7e00_0000_4000, nr_pages: 2, flags: 0 },
                PagemapEntry { vaddr: 0x7e00_0010_0000, nr_pages: 1, flags: PE_PRESENT },
                PagemapEntry { vaddr: 0x7e00_0020_0000, nr_pages: 3, flags: PE_PARENT },
                PagemapEntry { vaddr: 0x7e00_0030_0000, nr_pages: 2, flags: PE_PRESENT | PE_LAZY },
            ],
        }
    }

    #[test]
    fn round_trips_and_computes_pages_offsets() {
        let p = sample();
        let b = encode_pagemap(&p);
        assert_eq!(&b[..4], &[0x19, 0x43, 0x56, 0x54]);
        let d = decode_pagemap(&b).unwrap();
        assert_eq!(d, p);
        // Offsets advance over present entries only (zero and parent entries hold no pages).
        let runs = d.runs();
        assert_eq!(runs.len(), 3);
        assert_eq!(runs[0], PagesRun { vaddr: 0x7e00_0000_0000, len: 4 * 4096, offset: 0, lazy: true });
        assert_eq!(runs[1], PagesRun { vaddr: 0x7e00_0010_0000, len: 4096, offset: 4 * 4096, lazy: false });
        assert_eq!(runs[2].offset, 5 * 4096);
        assert_eq!(d.pages_bytes(), 7 * 4096);
        assert_eq!(d.parent_ranges(), vec![(0x7e00_0020_0000, 0x7e00_0020_3000)]);
    }

    /// Hand-built bytes as protobuf-c writes them (field 1 varint, field 2 varint, ...),
    /// including the old in_parent form and an unknown field a newer CRIU might add.
    #[test]
    fn decodes_compat_forms_and_skips_unknown_fields() {
        let mut b = Vec::new();
        b.extend_from_slice(&IMG_COMMON_MAGIC.to_le_bytes());
        b.extend_from_slice(&PAGEMAP_MAGIC.to_le_bytes());
        put_message(&mut b, &[0x08, 0x01]); // pages_id = 1
                                            // vaddr = 0x1000, nr_pages = 1, no flags: present (old image).
        put_message(&mut b, &[0x08, 0x80, 0x20, 0x10, 0x01]);
        // vaddr = 0x2000, nr_pages = 1, in_parent = true, no flags: parent.
        put_message(&mut b, &[0x08, 0x80, 0x40, 0x10, 0x01, 0x18, 0x01]);
        // vaddr = 0x3000, nr_pages = 2, flags = 6, plus field 9 (bytes) and 10 (fixed32).
        put_message(&mut b, &[0x08, 0x80, 0x60, 0x10, 0x02, 0x20, 0x06, 0x4a, 0x02, 0xaa, 0xbb, 0x55, 1, 2, 3, 4]);
        let d = decode_pagemap(&b).unwrap();
        assert_eq!(d.pages_id, 1);
        assert_eq!(
            d.entries,
            vec![
                PagemapEntry { vaddr: 0x1000, nr_pages: 1, flags: PE_PRESENT },
                PagemapEntry { vaddr: 0x2000, nr_pages: 1, flags: PE_PARENT },
                PagemapEntry { vaddr: 0x3000, nr_pages: 2, flags: PE_PRESENT | PE_LAZY },
            ]
        );
        // A head alone is a valid (empty) pagemap.
        let head_only = encode_pagemap(&Pagemap { pages_id: 7, entries: vec![] });
        assert_eq!(decode_pagemap(&head_only).unwrap().entries.len(), 0);
    }

    #[test]
    fn refuses_bad_input_with_typed_errors() {
        let good = encode_pagemap(&sample());
        assert!(matches!(decode_pagemap(&[]), Err(PagemapError::Truncated(0))));
        assert!(matches!(decode_pagemap(&good[..6]), Err(PagemapError::Truncated(_))));
        let mut b = good.clone();
        b[0] ^= 1;
        assert!(matches!(decode_pagemap(&b), Err(PagemapError::CommonMagic(_))));
        let mut b = good.clone();
        b[4] ^= 1;
        assert!(matches!(decode_pagemap(&b), Err(PagemapError::Magic(_))));
        // Every strict prefix past the magic is truncated (or, cut at a message boundary,
        // a shorter valid pagemap).
        for n in 9..good.len() {
            match decode_pagemap(&good[..n]) {
                Err(PagemapError::Truncated(_)) | Err(PagemapError::Protobuf { .. }) | Ok(_) => {}
                other => panic!("prefix {n}: {other:?}"),
            }
        }
        // An absurd message length is refused before any allocation.
        let mut b = good[..8].to_vec();
        b.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(decode_pagemap(&b), Err(PagemapError::MessageTooLong { len: u32::MAX, .. })));
        // Magic alone: no head.
        assert_eq!(decode_pagemap(&good[..8]), Err(PagemapError::NoHead));
        let entry = |msg: &[u8]| {
            let mut b = encode_pagemap(&Pagemap { pages_id: 1, entries: vec![] });
            put_message(&mut b, msg);
            decode_pagemap(&b).unwrap_err().to_string()
        };
        assert!(entry(&[0x10, 0x01]).contains("no vaddr"));
        assert!(entry(&[0x08, 0x80, 0x20]).contains("no nr_pages"));
        assert!(entry(&[0x08, 0x81, 0x20, 0x10, 0x01]).contains("not page-aligned"));
        assert!(entry(&[0x08, 0x80, 0x20, 0x10, 0x00]).contains("nr_pages 0"));
        assert!(entry(&[0x08, 0x80, 0x20, 0x10, 0x01, 0x20, 0x08]).contains("unknown flags"));
        assert!(entry(&[0x08, 0x80, 0x20, 0x10, 0x01, 0x20, 0x05]).contains("both PE_PARENT and PE_PRESENT"));
        assert!(entry(&[0x08, 0x80, 0x20, 0x10, 0x01, 0x20, 0x80, 0x80, 0x80, 0x80, 0x10]).contains("not a uint32"));
        assert!(entry(&[0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02]).contains("overflows"));
        assert!(entry(&[0x08, 0x80]).contains("truncated varint"));
        assert!(entry(&[0x0b]).contains("wire type 3"));
        assert!(entry(&[0x09, 0, 0, 0, 0, 0, 0, 0, 0]).contains("expected a varint"));
        assert!(entry(&[0x4a, 0x05, 0x01]).contains("truncated length-delimited"));
        assert!(entry(&[0x00]).contains("field number 0"));
        // Beyond the address space, and unsorted / overlapping entries.
        let e = |vaddr, nr_pages| PagemapEntry { vaddr, nr_pages, flags: PE_PRESENT };
        let too_high = encode_pagemap(&Pagemap { pages_id: 1, entries: vec![e(MAX_VADDR - 4096, 2)] });
        assert!(decode_pagemap(&too_high).unwrap_err().to_string().contains("beyond the user address space"));
        let overlap = encode_pagemap(&Pagemap { pages_id: 1, entries: vec![e(0x10000, 4), e(0x12000, 1)] });
        assert!(decode_pagemap(&overlap).unwrap_err().to_string().contains("not after the previous entry"));
        let big = vec![0u8; MAX_PAGEMAP_BYTES + 1];
        assert!(matches!(decode_pagemap(&big), Err(PagemapError::TooLarge(_))));
    }
}
