//! `Image::open` and `verify::audit` over an in-memory store: a hostile store chooses the
//! config and index bytes; opening must never panic or over-allocate, what opens must be
//! internally consistent, and auditing it must not panic either.
//!
//! Input: `config JSON ‖ 0x00 ‖ index bytes`. The harness does what a liar would do to get
//! past the digest checks: it rewrites the config's `index` to the index's real digest and
//! size, and builds a manifest listing the index and every spec-vector blob (so fuzzed
//! configs can name the vectors' parents, bases and packs, which the store also holds).
#![no_main]

use imgfmt::index::chunk_count;
use imgfmt::{media, Descriptor, Image, Manifest, OciDigest, StoredAt};
use libfuzzer_sys::fuzz_target;
use snapctl_fuzz::MemSource;

fuzz_target!(|data: &[u8]| {
    let (cfg, idx) = match data.iter().position(|&b| b == 0) {
        Some(p) => (&data[..p], &data[p + 1..]),
        None => (data, &[][..]),
    };
    let mut src = MemSource::new();
    let index_digest = src.put(idx.to_vec());
    let cfg = match serde_json::from_slice::<serde_json::Value>(cfg) {
        Ok(mut v) => {
            if let Some(o) = v.as_object_mut() {
                o.insert("index".into(), serde_json::json!({ "digest": index_digest.as_str(), "size": idx.len() }));
            }
            serde_json::to_vec(&v).expect("re-serialize")
        }
        Err(_) => cfg.to_vec(),
    };
    let cfg_len = cfg.len() as u64;
    let config_digest = src.put(cfg);
    let mut layers = vec![Descriptor::new(media::INDEX, index_digest, idx.len() as u64)];
    let mut shared: Vec<(&OciDigest, &Vec<u8>)> = src.shared.iter().collect();
    shared.sort();
    layers.extend(shared.into_iter().map(|(d, b)| Descriptor::new(media::PACK, d.clone(), b.len() as u64)));
    let manifest = Manifest {
        schema_version: 2,
        media_type: Some(media::OCI_MANIFEST.into()),
        artifact_type: Some(media::ARTIFACT_TYPE.into()),
        config: Descriptor::new(media::CONFIG, config_digest, cfg_len),
        layers,
        subject: None,
        annotations: Default::default(),
    };
    let manifest_digest = src.put(manifest.encode());

    let Ok(img) = Image::open(&src, &manifest_digest) else { return };
    // What opened is consistent: every file has exactly its chunks, of the right lengths,
    // and every stored chunk points into a listed pack.
    let shift = img.chunk_shift();
    assert_eq!(img.files.len(), img.config().files.len());
    for f in &img.files {
        assert_eq!(f.chunks.len() as u64, chunk_count(f.size, shift));
        assert_eq!(f.chunks.iter().map(|c| c.len as u64).sum::<u64>(), f.size);
        for c in &f.chunks {
            if let StoredAt::Pack { pack, .. } = c.at {
                assert!((pack as usize) < img.packs.len());
            }
        }
    }
    let opts = verify::AuditOptions { threads: 1, blob_digests: true, ..Default::default() };
    let _ = verify::audit(&src, &img, &opts);
    for (fi, f) in img.files.iter().enumerate() {
        for c in 0..f.chunks.len().min(4) {
            let _ = verify::read_chunk(&src, &img, fi, c as u64);
        }
    }
});
