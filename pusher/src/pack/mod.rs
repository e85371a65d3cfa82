//! `pack`: a checkpoint directory becomes an image in a local OCI layout.
//!
//! One job per module: what a pack is asked and reports (`options`), the pack pipeline
//! (`pipeline`), chunking (`chunker`), where chunks go (`placement`), the outboard
//! (`outboard`), compaction (`compaction`), the manifest's other parts (`layers`), and
//! whether an image holds the same files as a directory (`same`).

mod chunker;
mod compaction;
mod layers;
mod options;
mod outboard;
mod pipeline;
mod placement;
mod same;
#[cfg(test)]
mod tests;

pub use layers::ensure_blob;
pub use options::{OnPack, PackError, PackOptions, PackReport, Related, DEFAULT_BASE_DELTA_LEVEL, DEFAULT_COMPACT_AFTER, DEFAULT_PACK_SIZE};
pub use same::{same_files, same_files_of_config, NotSameFiles};

use chunker::{chunk_into_packs, ChunkInput, Chunked};
use compaction::{excess_packs, Compaction};
use layers::{ancestor_layers, foreign_pack_layers, image_config, manifest_annotations};
use outboard::{base_outboard_layer, outboard_of_pack, own_outboard_layer, shared_base_outboard};
use placement::{add_chain_packs, foreign_packs, known_chunks, Placement, Slots};

use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

use imgfmt::config::{BlobRef, MAX_CHAIN_DEPTH};
use imgfmt::{media, Descriptor, Kind, Manifest, OciLayout};

use crate::scan;

/// Pack `src_dir` into `dest` and tag it `tag`.
pub fn pack(src_dir: &Path, dest: &OciLayout, tag: &str, opts: &PackOptions) -> Result<PackReport, PackError> {
    pack_scanned(&scan::DirScan::take(src_dir)?, dest, tag, opts)
}

/// [`pack`] of a directory walked already: its files are read as `scan` lists them (the
/// directory is not listed again).
pub fn pack_scanned(scan: &scan::DirScan, dest: &OciLayout, tag: &str, opts: &PackOptions) -> Result<PackReport, PackError> {
    let t0 = Instant::now();
    imgfmt::layout::check_tag(tag)?;
    check_options(opts)?;
    let algo = opts.hash;
    // A layer has its parent's ancestors plus the parent. Past the limit, rebase: the
    // same records a full image would have, pointing where the chain stored the bytes.
    let rebase = opts.parent.as_ref().is_some_and(|p| p.image.chain.len() > opts.max_chain);
    // Packs of the chain a rebased image points into are no ancestor's any more.
    let chain_owner = if rebase { media::OWNER_REBASED } else { "parent" };
    let (files, kind) = source_files(scan, opts)?;
    let mut report = PackReport { kind: kind.to_string(), files: files.len(), skipped: scan.skipped.clone(), ..Default::default() };

    let compaction = Compaction::plan(opts);
    if let Some(c) = &compaction {
        report.compacted = true;
        report.packs_retired = c.retired.len();
    }
    let retired = compaction.map(|c| c.retired).unwrap_or_default();
    let known = known_chunks(opts, chain_owner, &retired);
    let parent_files: HashMap<&str, &imgfmt::ResolvedFile> = opts.parent.iter().flat_map(|r| r.image.files.iter().map(|f| (f.name.as_str(), f))).collect();
    let mut slots = Slots::default();
    let base_outboard = shared_base_outboard(opts);
    let input = ChunkInput { opts, parent_files: &parent_files, known: &known, retired: &retired, base_outboard: base_outboard.as_ref().map(|(_, ob)| ob) };
    let (Chunked { placed, own_bytes, slices, base_outboard_used }, own_packs) = chunk_into_packs(dest, &files, &input, &mut slots, &mut report)?;
    report.pack_bytes = own_bytes;
    report.packs = own_packs.len();
    let placement = Placement { files: &files, placed: &placed, parent_files: &parent_files };

    if rebase {
        add_chain_packs(opts, &placement, &mut slots, chain_owner);
    }
    let (index, entries, roots) = placement.index(opts, rebase, &slots, &own_packs)?;
    let outboard = match slices {
        Some(s) => outboard_of_pack(&index, s, opts, rebase, base_outboard.as_ref().map(|(_, ob)| ob))?,
        None => None,
    };
    let image_root = verify::image_root(algo, files.iter().zip(&roots).map(|(f, r)| (f.name.as_str(), f.size, *r)));
    let index_bytes = index.encode();
    let index_digest = dest.put_blob(&index_bytes)?;

    let index_ref = BlobRef { digest: index_digest.clone(), size: index_bytes.len() as u64 };
    let config = image_config(opts, rebase, kind, entries, image_root.display_with(algo), index_ref);
    let config_bytes = config.encode();
    let config_digest = dest.put_blob(&config_bytes)?;

    // Manifest layers: own index and packs, the parent chain's configs and indexes, and
    // every foreign pack a chunk of the resolved image points into.
    let mut layers = vec![Descriptor::new(media::INDEX, index_digest.clone(), index_bytes.len() as u64).with_annotation(media::ANN_OWNER, "self")];
    for (d, size) in &own_packs {
        layers.push(Descriptor::new(media::PACK, d.clone(), *size).with_annotation(media::ANN_OWNER, "self"));
    }
    if let Some(ob) = &outboard {
        layers.push(own_outboard_layer(dest, ob, &mut report)?);
    }
    let parent = opts.parent.as_ref().filter(|_| !rebase);
    if let Some(p) = parent {
        layers.extend(ancestor_layers(dest, p)?);
    }
    if let Some(d) = base_outboard_layer(dest, opts, base_outboard_used, base_outboard.as_ref())? {
        layers.push(Descriptor::new(media::OUTBOARD, d.digest, d.size).with_annotation(media::ANN_OWNER, "base"));
    }
    let foreign = foreign_packs(&slots, parent.map(|p| (p, &placement)));
    layers.extend(foreign_pack_layers(dest, opts, &foreign)?);
    let annotations = manifest_annotations(opts, rebase, &config, kind, &foreign, &mut report);
    report.chain_depth = match &opts.parent {
        Some(p) if !rebase => p.image.chain.len(),
        _ => 0,
    };
    report.excess_packs = excess_packs(&placement, opts, &index);
    let manifest = Manifest {
        schema_version: 2,
        media_type: Some(media::OCI_MANIFEST.into()),
        artifact_type: Some(media::ARTIFACT_TYPE.into()),
        config: Descriptor::new(media::CONFIG, config_digest, config_bytes.len() as u64),
        layers,
        subject: None,
        annotations,
    };
    let manifest_bytes = manifest.encode();
    let manifest_digest = dest.put_blob(&manifest_bytes)?;
    dest.set_tag(
        tag,
        Descriptor::new(media::OCI_MANIFEST, manifest_digest.clone(), manifest_bytes.len() as u64).with_annotation(media::ANN_ROOT, config.root.clone()),
    )?;

    report.manifest = manifest_digest.to_string();
    report.root = config.root;
    report.metadata_bytes = (manifest_bytes.len() + config_bytes.len() + index_bytes.len()) as u64 + report.outboard_bytes;
    report.seconds = t0.elapsed().as_secs_f64();
    Ok(report)
}

/// Refuse options no image can be made with before anything is read: sizes out of range,
/// a base or parent hashed or chunked differently, `--diff` without a parent, a chain
/// longer than readers open.
fn check_options(opts: &PackOptions) -> Result<(), PackError> {
    if !(imgfmt::MIN_CHUNK_SHIFT..=imgfmt::MAX_CHUNK_SHIFT).contains(&opts.chunk_shift) {
        return Err(PackError::Invalid(format!("chunk size 2^{} outside 64KiB..=16MiB", opts.chunk_shift)));
    }
    if opts.pack_size < (1u64 << opts.chunk_shift) {
        return Err(PackError::Invalid("pack size must be at least one chunk".into()));
    }
    if let Some(s) = opts.slice_shift {
        if !(imgfmt::outboard::MIN_SLICE_SHIFT..opts.chunk_shift).contains(&s) {
            return Err(PackError::Invalid(format!("slice size 2^{s} outside 4KiB..={}KiB (half a chunk)", (1u64 << opts.chunk_shift) >> 11)));
        }
    }
    let shift = opts.chunk_shift;
    let algo = opts.hash;
    for (what, rel) in [("base", &opts.base), ("parent", &opts.parent)] {
        if let Some(r) = rel {
            let c = r.image.config();
            if c.hash != algo || c.chunk_shift() != shift {
                return Err(PackError::Invalid(format!(
                    "{what} {} uses {} with {} KiB chunks; this pack uses {algo} with {} KiB chunks (pass the same --hash and --chunk-size)",
                    r.reference,
                    c.hash,
                    c.chunk_size >> 10,
                    (1u64 << shift) >> 10
                )));
            }
        }
    }
    if opts.diff && opts.parent.is_none() {
        return Err(PackError::Invalid("--diff needs --parent: a diff snapshot's holes mean 'as in the parent'".into()));
    }
    if opts.max_chain > MAX_CHAIN_DEPTH {
        return Err(PackError::Invalid(format!("--max-chain {}: readers open at most {MAX_CHAIN_DEPTH} ancestors", opts.max_chain)));
    }
    Ok(())
}

/// The source directory's files, given their roles, and the runtime kind.
fn source_files(scan: &scan::DirScan, opts: &PackOptions) -> Result<(Vec<scan::SourceFile>, Kind), PackError> {
    if scan.files.len() as u64 > imgfmt::index::MAX_FILES {
        return Err(PackError::Invalid(format!("{} files, at most {}", scan.files.len(), imgfmt::index::MAX_FILES)));
    }
    let kind = opts.kind.unwrap_or_else(|| scan::detect_kind(&scan.files));
    let mut files = scan.files.clone();
    for f in &mut files {
        imgfmt::config::check_name(&f.name)?;
        f.role = scan::role_of(kind, &f.name);
    }
    Ok((files, kind))
}
