//! The pack pipeline: a writer, a hasher and a sealer joined by channels, so no stage waits
//! on another's slow part.

use std::io::Write;
use std::sync::mpsc;

use imgfmt::digest::OciHasher;
use imgfmt::layout::BlobWriter;
use imgfmt::{FormatError, OciDigest, OciLayout};

use super::options::OnPack;

pub(super) enum ToWriter {
    Data(Vec<u8>),
    /// The current pack is complete; later data goes into a new one.
    Rollover,
    /// Every chunk was sent: seal the last pack. A pack still open when the channel closes
    /// without this (the packing failed) is discarded, never named.
    End,
}

pub(super) enum ToHasher {
    Data(Vec<u8>),
    /// All of this pack's bytes were sent before it.
    Seal(Box<BlobWriter>),
}

/// Bytes a pack writer lets pile up before starting their writeback.
pub(super) const WRITEBACK_EVERY: u64 = 8 << 20;

/// Pipeline stage 1: copy each chunk into the current pack file, then pass it on to be
/// hashed. Stops quietly when the hasher is gone (its own error is the cause).
pub(super) fn write_packs(layout: &OciLayout, rx: mpsc::Receiver<ToWriter>, to_hasher: mpsc::SyncSender<ToHasher>) -> Result<(), FormatError> {
    let mut cur: Option<BlobWriter> = None;
    for msg in rx {
        let ToWriter::Data(b) = msg else {
            // Rollover or End: the pack being written is complete.
            if let Some(mut w) = cur.take() {
                w.start_writeback();
                if to_hasher.send(ToHasher::Seal(Box::new(w))).is_err() {
                    return Ok(());
                }
            }
            if matches!(msg, ToWriter::End) {
                break;
            }
            continue;
        };
        let w = match cur.as_mut() {
            Some(w) => w,
            None => cur.insert(layout.blob_writer_hashed_by_caller()?),
        };
        w.write_all(&b).map_err(|e| FormatError::Io { context: format!("writing a pack into {}", layout.root().display()), source: e })?;
        if w.unhinted() >= WRITEBACK_EVERY {
            w.start_writeback();
        }
        if to_hasher.send(ToHasher::Data(b)).is_err() {
            return Ok(());
        }
    }
    Ok(())
}

/// Pipeline stage 2: the SHA-256 of each pack, from the same bytes the writer wrote.
pub(super) fn hash_packs(rx: mpsc::Receiver<ToHasher>, to_sealer: mpsc::SyncSender<(BlobWriter, OciDigest)>) -> Result<(), FormatError> {
    let mut h = OciHasher::sha256();
    for msg in rx {
        match msg {
            ToHasher::Data(b) => h.update(&b),
            ToHasher::Seal(w) => {
                let d = std::mem::replace(&mut h, OciHasher::sha256()).finish();
                if to_sealer.send((*w, d)).is_err() {
                    return Ok(());
                }
            }
        }
    }
    Ok(())
}

/// Pipeline stage 3: make each finished pack durable under its name, in order, and
/// announce it (`push DIR` starts uploading it then, while later packs are being made).
pub(super) fn seal_packs(rx: mpsc::Receiver<(BlobWriter, OciDigest)>, on_pack: Option<OnPack>) -> Result<Vec<(OciDigest, u64)>, FormatError> {
    let mut done = Vec::new();
    for (w, d) in rx {
        let (d, size) = w.finish_as(d)?;
        if let Some(f) = on_pack {
            f(&d, size);
        }
        done.push((d, size));
    }
    Ok(done)
}
