//! Hostile images for the adversarial tests: consistent (every digest and root right,
//! every limit of `spec/format.md` §12 respected) and built to cost the client as much
//! memory as the format lets them.
//!
//! [`huge_index_image`] writes a chain of `layers` images over one file whose every chunk
//! is recorded in every link: one index of up to 256 MiB per link (4.19 M records, a
//! 4 TiB file at 1 MiB chunks). With [`Chunks::Zero`] every chunk is a zero chunk and
//! the image is consistent (no pack at all: `verify` says yes). With
//! [`Chunks::CorruptStored`] every chunk is a distinct stored chunk of one byte of a
//! small pack that does not decompress: the index and roots are consistent, every
//! chunk fails, and the client's per-chunk bookkeeping (distinct digests, work lists,
//! failures) is as large as it gets. Written directly (records, roots, config,
//! manifest) rather than packed from a sparse file: packing 4 TiB of holes takes many
//! minutes of `SEEK_DATA`.

use std::collections::BTreeMap;
use std::path::Path;

use imgfmt::compress::Codec;
use imgfmt::config::{BlobRef, ChainRef, FileEntry, ImageConfig, Kind, Role, CONFIG_FORMAT};
use imgfmt::index::{ChunkIndex, ChunkRecord, IndexFile, PackRef, RecordKind, FILE_ENTRY_LEN, HEADER_LEN, MAX_INDEX_BYTES, PACK_ENTRY_LEN, RECORD_LEN};
use imgfmt::{media, Descriptor, HashAlgo, Manifest, OciLayout};

/// Chunk size of the hostile images (1 MiB, the packer's default).
pub const CHUNK_SHIFT: u8 = 20;

/// The most records one index of one file (and one pack) can hold: the 256 MiB index
/// limit less the header, one file entry and one pack entry.
pub const MAX_RECORDS: u64 = (MAX_INDEX_BYTES - HEADER_LEN as u64 - FILE_ENTRY_LEN as u64 - PACK_ENTRY_LEN as u64) / RECORD_LEN as u64;

/// What the chunks of a [`huge_index_image`] are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Chunks {
    /// Zero chunks: a consistent image, a sparse file.
    Zero,
    /// Distinct stored chunks, one byte each in one pack, that do not decompress.
    CorruptStored,
}

/// What [`huge_index_image`] wrote.
#[derive(Debug, Clone)]
pub struct HugeImage {
    /// Manifest digest of the top image.
    pub manifest: String,
    /// Bytes of every index blob of the chain together.
    pub index_bytes: u64,
    /// Size of the one file (`vm.mem`).
    pub file_size: u64,
}

/// Write into layout `dir` (created if missing), under `tag`, a chain of `layers` images
/// (1 = a plain image) of one file `vm.mem` of `chunks` chunks of kind `kind`, each link
/// recording every chunk again. `chunks` at most [`MAX_RECORDS`].
pub fn huge_index_image(dir: &Path, tag: &str, chunks: u64, layers: usize, kind: Chunks) -> HugeImage {
    assert!(chunks <= MAX_RECORDS && layers >= 1);
    let layout = OciLayout::open_or_create(dir).expect("layout");
    let algo = HashAlgo::Blake3;
    let size = chunks << CHUNK_SHIFT;
    let (records, packs): (Vec<ChunkRecord>, Vec<PackRef>) = match kind {
        Chunks::Zero => {
            let zero = verify::zero_digest(algo, 1 << CHUNK_SHIFT);
            ((0..chunks).map(|c| ChunkRecord { chunk: c, kind: RecordKind::Zero, digest: zero }).collect(), vec![])
        }
        Chunks::CorruptStored => {
            // 0xff is no zstd frame; each chunk's digest is distinct.
            let pack = vec![0xffu8; chunks as usize];
            let digest = layout.put_blob(&pack).expect("put pack");
            let records = (0..chunks)
                .map(|c| ChunkRecord {
                    chunk: c,
                    kind: RecordKind::Stored { pack: 0, offset: c, stored_len: 1, codec: Codec::Zstd },
                    digest: verify::chunk_digest(algo, &c.to_le_bytes()),
                })
                .collect();
            (records, vec![PackRef { digest, size: chunks }])
        }
    };
    // Every link resolves to the same content: one root for all.
    let file_root = verify::file_root(algo, &records.iter().map(|r| r.digest).collect::<Vec<_>>());
    let root = verify::image_root(algo, [("vm.mem", size, file_root)]).display_with(algo);
    let mut index_bytes = 0u64;
    let mut parent: Option<(ChainRef, Vec<Descriptor>)> = None;
    let mut top = None;
    for _ in 0..layers {
        let index = ChunkIndex {
            hash: algo,
            chunk_shift: CHUNK_SHIFT,
            layer: parent.is_some(),
            files: vec![IndexFile { size, first_record: 0, record_count: chunks }],
            packs: packs.clone(),
            records: records.clone(),
        };
        let ib = index.encode();
        drop(index);
        index_bytes += ib.len() as u64;
        let index_digest = layout.put_blob(&ib).expect("put index");
        let config = ImageConfig {
            format: CONFIG_FORMAT.into(),
            kind: Kind::Firecracker,
            created: "2025-01-01T00:00:00Z".into(),
            chunk_size: 1 << CHUNK_SHIFT,
            hash: algo,
            compression: if packs.is_empty() { "none" } else { "zstd" }.into(),
            files: vec![FileEntry { name: "vm.mem".into(), size, mode: 0o600, role: Role::Memory, chunks, root: file_root.display_with(algo) }],
            root: root.clone(),
            index: BlobRef { digest: index_digest.clone(), size: ib.len() as u64 },
            parent: parent.as_ref().map(|(r, _)| r.clone()),
            base: None,
            annotations: BTreeMap::new(),
        };
        let cb = config.encode();
        let config_digest = layout.put_blob(&cb).expect("put config");
        let mut layers_desc = vec![Descriptor::new(media::INDEX, index_digest.clone(), ib.len() as u64)];
        // Every link lists the one pack (the packer lists the packs a resolved chunk uses).
        layers_desc.extend(packs.iter().map(|p| Descriptor::new(media::PACK, p.digest.clone(), p.size)));
        // The parent chain's configs and indexes, as the packer lists them.
        let inherited = parent.as_ref().map(|(_, d)| d.clone()).unwrap_or_default();
        layers_desc.extend(inherited.iter().cloned());
        let mut annotations = BTreeMap::new();
        annotations.insert(media::ANN_ROOT.to_string(), root.clone());
        let manifest = Manifest {
            schema_version: 2,
            media_type: Some(media::OCI_MANIFEST.into()),
            artifact_type: Some(media::ARTIFACT_TYPE.into()),
            config: Descriptor::new(media::CONFIG, config_digest.clone(), cb.len() as u64),
            layers: layers_desc,
            subject: None,
            annotations,
        };
        let mb = manifest.encode();
        let manifest_digest = layout.put_blob(&mb).expect("put manifest");
        let mut chain_descs =
            vec![Descriptor::new(media::CONFIG, config_digest.clone(), cb.len() as u64), Descriptor::new(media::INDEX, index_digest.clone(), ib.len() as u64)];
        chain_descs.extend(inherited);
        let r = ChainRef { manifest: manifest_digest.clone(), config: config_digest, index: index_digest, root: root.clone(), reference: None };
        parent = Some((r, chain_descs));
        top = Some((manifest_digest, mb.len() as u64));
    }
    let (manifest, len) = top.expect("at least one layer");
    layout.set_tag(tag, Descriptor::new(media::OCI_MANIFEST, manifest.clone(), len)).expect("tag");
    HugeImage { manifest: manifest.to_string(), index_bytes, file_size: size }
}

/// Run `cmd` under the `peak_rss` helper (`env!("CARGO_BIN_EXE_peak_rss")` in a test);
/// returns its exit code and its peak resident memory in bytes (a memory bound, not a
/// timing: the same however busy the machine is).
pub fn run_peak_rss(helper: &Path, cmd: &mut std::process::Command) -> (i32, u64) {
    let out = tempfile::NamedTempFile::new().expect("temp file");
    let mut wrapped = std::process::Command::new(helper);
    wrapped.arg(out.path()).arg(cmd.get_program()).args(cmd.get_args());
    for (k, v) in cmd.get_envs() {
        match v {
            Some(v) => wrapped.env(k, v),
            None => wrapped.env_remove(k),
        };
    }
    let st = wrapped.status().expect("run peak_rss");
    let peak = std::fs::read_to_string(out.path()).expect("peak_rss wrote its result").trim().parse().expect("a number");
    (st.code().unwrap_or(-1), peak)
}
