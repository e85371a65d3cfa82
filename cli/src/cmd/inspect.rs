//! `snapctl inspect`: what an image holds and what it costs.

use std::collections::HashSet;
use std::process::ExitCode;

use imgfmt::size::human;
use imgfmt::{media, Image, StoredAt};
use serde::Serialize;

use super::common::{self, open_image_in, open_origin, outln};

/// Show an image: kind, files, sizes, chunk counts (zero / stored / referenced /
/// inherited), compression ratio, roots, the base/parent chain, and what is attached to it
/// (referrers: signatures, SBOMs, recorded traces; cosign's sha256-<hex>.sig tags).
#[derive(Debug, clap::Args)]
pub struct InspectArgs {
    /// Image: oci:PATH[:TAG|@DIGEST] or HOST[:PORT]/REPO[:TAG|@DIGEST] (plain HTTP for loopback
    /// hosts or with SNAPCTL_PLAIN_HTTP=1; credentials from ~/.docker/config.json).
    pub image: String,
    /// Print JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Default, Serialize)]
pub struct Counts {
    pub chunks: u64,
    pub zero: u64,
    /// In this image's own packs.
    pub stored: u64,
    /// Recorded by this image but pointing into a base's or ancestor's packs.
    pub referenced: u64,
    /// Not recorded by this image: inherited from the parent chain.
    pub inherited: u64,
    /// Uncompressed bytes of non-zero chunks.
    pub data_bytes: u64,
    /// Stored (possibly compressed) bytes of those chunks, wherever they live.
    pub stored_bytes: u64,
}

#[derive(Debug, Serialize)]
struct FileOut {
    name: String,
    role: String,
    size: u64,
    mode: String,
    root: String,
    #[serde(flatten)]
    counts: Counts,
}

#[derive(Debug, Serialize)]
struct Out {
    manifest: String,
    kind: String,
    created: String,
    root: String,
    chunk_size: u64,
    hash: String,
    compression: String,
    size: u64,
    files: Vec<FileOut>,
    totals: Counts,
    compression_ratio: f64,
    own_pack_bytes: u64,
    metadata_bytes: u64,
    packs: usize,
    chain: Vec<serde_json::Value>,
    /// A rebased image: the manifest of the layer it would have been a layer over
    /// (provenance only; its chunks are its own records).
    #[serde(skip_serializing_if = "Option::is_none")]
    rebased_from: Option<String>,
    base: Option<serde_json::Value>,
    /// Referrers and subject-named tags (and theirs), as `copy` carries them.
    referrers: Vec<pusher::referrers::Attached>,
}

/// Pack blobs this image wrote itself (as opposed to ones it inherits or references).
fn own_packs(image: &Image) -> impl Iterator<Item = &imgfmt::Descriptor> {
    image.manifest.layers.iter().filter(|d| d.media_type == media::PACK && d.annotations.get(media::ANN_OWNER).is_some_and(|o| o == "self"))
}

pub fn counts(image: &Image) -> (Vec<Counts>, Counts) {
    let own: HashSet<&imgfmt::OciDigest> = own_packs(image).map(|d| &d.digest).collect();
    let mut total = Counts::default();
    let mut per = Vec::new();
    for f in &image.files {
        let mut c = Counts::default();
        for ch in &f.chunks {
            c.chunks += 1;
            match ch.at {
                StoredAt::Zero if ch.depth == 0 => c.zero += 1,
                StoredAt::Zero => c.inherited += 1,
                StoredAt::Pack { pack, stored_len, .. } => {
                    c.data_bytes += ch.len as u64;
                    c.stored_bytes += stored_len as u64;
                    if ch.depth > 0 {
                        c.inherited += 1;
                    } else if own.contains(&image.packs[pack as usize].digest) {
                        c.stored += 1;
                    } else {
                        c.referenced += 1;
                    }
                }
            }
        }
        total.chunks += c.chunks;
        total.zero += c.zero;
        total.stored += c.stored;
        total.referenced += c.referenced;
        total.inherited += c.inherited;
        total.data_bytes += c.data_bytes;
        total.stored_bytes += c.stored_bytes;
        per.push(c);
    }
    (per, total)
}

pub fn run(a: InspectArgs) -> anyhow::Result<ExitCode> {
    let (origin, selector) = open_origin(&a.image, false)?;
    let image = open_image_in(origin.source(), &selector, &a.image)?;
    let referrers = match pusher::referrers::attached_tree(&origin, &image.manifest_digest) {
        Ok(r) => r,
        Err(e) => {
            // The image is shown all the same; its attachments are a listing apart.
            tracing::warn!("could not list what is attached to {}: {e}", a.image);
            Vec::new()
        }
    };
    let cfg = image.config();
    let (per, totals) = counts(&image);
    let own_pack_bytes: u64 = own_packs(&image).map(|d| d.size).sum();
    let metadata_bytes = image.manifest_bytes.len() as u64 + image.manifest.config.size + cfg.index.size;
    let chain: Vec<serde_json::Value> = image
        .chain
        .iter()
        .skip(1)
        .zip(image.chain.iter())
        .map(|(link, child)| {
            let p = child.config.parent.as_ref().expect("has parent");
            serde_json::json!({"manifest": p.manifest, "root": p.root, "reference": p.reference, "created": link.config.created})
        })
        .collect();
    let out = Out {
        manifest: image.manifest_digest.to_string(),
        kind: cfg.kind.to_string(),
        created: cfg.created.clone(),
        root: cfg.root.clone(),
        chunk_size: cfg.chunk_size,
        hash: cfg.hash.to_string(),
        compression: cfg.compression.clone(),
        size: image.files.iter().map(|f| f.size).sum(),
        files: image
            .files
            .iter()
            .zip(per)
            .zip(&cfg.files)
            .map(|((f, counts), cf)| FileOut {
                name: f.name.clone(),
                role: f.role.to_string(),
                size: f.size,
                mode: format!("{:04o}", f.mode),
                root: cf.root.clone(),
                counts,
            })
            .collect(),
        compression_ratio: if totals.stored_bytes == 0 { 1.0 } else { totals.data_bytes as f64 / totals.stored_bytes as f64 },
        totals,
        own_pack_bytes,
        metadata_bytes,
        packs: image.packs.len(),
        chain,
        rebased_from: image.manifest.annotations.get(media::ANN_REBASED_FROM).cloned(),
        base: cfg.base.as_ref().map(|b| serde_json::json!({"manifest": b.manifest, "root": b.root, "reference": b.reference})),
        referrers,
    };
    if a.json {
        common::print_json(&out)?;
        return Ok(common::code(common::EXIT_OK));
    }
    // Strings from the image's config are escaped (the JSON above is, by serde_json).
    let p = common::printable;
    outln!("image        {}", out.manifest)?;
    outln!("kind         {}", out.kind)?;
    outln!("created      {}", p(&out.created))?;
    outln!("root         {}", p(&out.root))?;
    outln!("chunks       {} of {}, {}, compression {}", out.totals.chunks, human(out.chunk_size), out.hash, p(&out.compression))?;
    outln!("size         {} logical, {} non-zero data", human(out.size), human(out.totals.data_bytes))?;
    outln!(
        "storage      {} in own packs, {} metadata, {} pack(s) referenced, compression ratio {:.2}",
        human(out.own_pack_bytes),
        human(out.metadata_bytes),
        out.packs,
        out.compression_ratio
    )?;
    for (i, c) in out.chain.iter().enumerate() {
        outln!("parent[{}]    {} {}", i + 1, c["manifest"].as_str().unwrap_or(""), p(c["reference"].as_str().unwrap_or("")))?;
    }
    if let Some(r) = &out.rebased_from {
        outln!("rebased from {} (a full index into that chain's packs)", p(r))?;
    }
    if let Some(b) = &out.base {
        outln!("base         {} {}", b["manifest"].as_str().unwrap_or(""), p(b["reference"].as_str().unwrap_or("")))?;
    }
    outln!()?;
    outln!("{:<24} {:<9} {:>10} {:>7} {:>7} {:>7} {:>7} {:>7}", "FILE", "ROLE", "SIZE", "CHUNKS", "ZERO", "STORED", "REFD", "INHER")?;
    for f in &out.files {
        outln!(
            "{:<24} {:<9} {:>10} {:>7} {:>7} {:>7} {:>7} {:>7}",
            p(&f.name),
            f.role,
            human(f.size),
            f.counts.chunks,
            f.counts.zero,
            f.counts.stored,
            f.counts.referenced,
            f.counts.inherited
        )?;
    }
    let t = &out.totals;
    outln!("{:<24} {:<9} {:>10} {:>7} {:>7} {:>7} {:>7} {:>7}", "total", "", human(out.size), t.chunks, t.zero, t.stored, t.referenced, t.inherited)?;
    if !out.referrers.is_empty() {
        outln!()?;
        outln!("{:<48} {:<73} {:>10}  TAG", "REFERRER (ARTIFACT TYPE)", "DIGEST", "SIZE")?;
        for r in &out.referrers {
            let nested = if r.subject == image.manifest_digest { "" } else { "  " };
            outln!(
                "{nested}{:<48} {:<73} {:>10}  {}",
                p(r.artifact_type.as_deref().unwrap_or(&r.media_type)),
                r.digest,
                human(r.size),
                p(r.tag.as_deref().unwrap_or(""))
            )?;
        }
    }
    Ok(common::code(common::EXIT_OK))
}
