//! The manifest's parts besides the index and packs: ancestors' layers, foreign packs,
//! annotations and the config; copying a blob into the layout.

use std::collections::BTreeMap;
use std::io::Write;

use imgfmt::config::{BlobRef, ChainRef, FileEntry, CONFIG_FORMAT};
use imgfmt::{media, BlobSource, Descriptor, FormatError, ImageConfig, Kind, OciDigest, OciLayout};

use super::options::{PackError, PackOptions, PackReport, Related};

/// The foreign packs as layers, by owner. Each is copied into `dest` from the base or
/// parent it comes from, except a parent's when the parent's packs are stored elsewhere.
pub(super) fn foreign_pack_layers(
    dest: &OciLayout,
    opts: &PackOptions,
    foreign: &BTreeMap<OciDigest, (u64, &'static str, bool)>,
) -> Result<Vec<Descriptor>, PackError> {
    let mut layers = Vec::with_capacity(foreign.len());
    for (d, (size, owner, from_base)) in foreign {
        let src = if *from_base { opts.base.as_ref() } else { opts.parent.as_ref() }.expect("foreign pack has a source").source;
        if *from_base || !opts.parent_packs_elsewhere {
            ensure_blob(dest, src, d)?;
        }
        layers.push(Descriptor::new(media::PACK, d.clone(), *size).with_annotation(media::ANN_OWNER, *owner));
    }
    Ok(layers)
}

/// The manifest's annotations: root, kind, creation, and for a rebased image what it was
/// rebased from (noted in `report` with the chain packs it refers to).
pub(super) fn manifest_annotations(
    opts: &PackOptions,
    rebase: bool,
    config: &ImageConfig,
    kind: Kind,
    foreign: &BTreeMap<OciDigest, (u64, &'static str, bool)>,
    report: &mut PackReport,
) -> BTreeMap<String, String> {
    let mut annotations = BTreeMap::new();
    annotations.insert(media::ANN_ROOT.to_string(), config.root.clone());
    annotations.insert(media::ANN_KIND.to_string(), kind.to_string());
    annotations.insert(media::ANN_CREATED.to_string(), config.created.clone());
    if rebase {
        let p = opts.parent.as_ref().expect("rebase has a parent");
        annotations.insert(media::ANN_REBASED_FROM.to_string(), p.image.manifest_digest.to_string());
        report.rebased = true;
        report.rebased_from = Some(p.image.manifest_digest.to_string());
        report.chain_packs_referenced = foreign.values().filter(|(_, owner, _)| *owner == media::OWNER_REBASED).count();
    }
    annotations
}

/// The manifest layers of a layer's ancestors, copied into `dest` when missing: each
/// one's config, index and outboard (so a lazy reader of this layer can verify slices of
/// the chunks it inherits: an outboard covers only its own index's records).
pub(super) fn ancestor_layers(dest: &OciLayout, p: &Related) -> Result<Vec<Descriptor>, PackError> {
    let mut layers = Vec::new();
    for (k, link) in p.image.chain.iter().enumerate() {
        let owner = vec!["parent"; k + 1].join(".");
        ensure_blob(dest, p.source, &link.config_digest)?;
        ensure_blob(dest, p.source, &link.index_digest)?;
        // The copy just ensured is local: asking a registry instead cost a round trip
        // per ancestor, one after the other.
        let cs = dest.blob_size(&link.config_digest)?;
        layers.push(Descriptor::new(media::CONFIG, link.config_digest.clone(), cs).with_annotation(media::ANN_OWNER, owner.clone()));
        layers.push(Descriptor::new(media::INDEX, link.index_digest.clone(), link.config.index.size).with_annotation(media::ANN_OWNER, owner.clone()));
        if let Some(ob) = &link.outboard_blob {
            ensure_blob(dest, p.source, &ob.digest)?;
            layers.push(Descriptor::new(media::OUTBOARD, ob.digest.clone(), ob.size).with_annotation(media::ANN_OWNER, owner));
        }
    }
    Ok(layers)
}

/// The config of the image being packed.
pub(super) fn image_config(opts: &PackOptions, rebase: bool, kind: Kind, files: Vec<FileEntry>, root: String, index: BlobRef) -> ImageConfig {
    let chain_ref = |r: &Related| ChainRef {
        manifest: r.image.manifest_digest.clone(),
        config: r.image.chain[0].config_digest.clone(),
        index: r.image.chain[0].index_digest.clone(),
        root: r.image.config().root.clone(),
        reference: Some(r.reference.clone()),
    };
    ImageConfig {
        format: CONFIG_FORMAT.into(),
        kind,
        created: created_now(),
        chunk_size: 1 << opts.chunk_shift,
        hash: opts.hash,
        compression: opts.compression.to_string(),
        files,
        root,
        index,
        parent: opts.parent.as_ref().filter(|_| !rebase).map(chain_ref),
        base: opts.base.as_ref().map(chain_ref),
        annotations: opts.annotations.clone(),
    }
}

/// Make sure `dest` holds blob `d`, copying it from `src` (and checking its digest on
/// the way) when it is not there yet.
pub fn ensure_blob(dest: &OciLayout, src: &dyn BlobSource, d: &OciDigest) -> Result<(), PackError> {
    if dest.has_blob(d) {
        return Ok(());
    }
    let size = src.blob_size(d)?;
    let mut w = dest.blob_writer()?;
    imgfmt::source::stream_blob_unverified::<FormatError>(src, d, size, |piece| {
        w.write_all(piece).map_err(|e| FormatError::Io { context: "copy blob".into(), source: e })
    })?;
    let (got, _) = w.finish()?;
    if &got != d {
        // The blob landed under its real name, which is harmless; the one we needed is
        // still missing, which is the error.
        return Err(FormatError::BlobDigestMismatch { digest: d.clone(), actual: got }.into());
    }
    Ok(())
}

/// RFC 3339 now, or `SOURCE_DATE_EPOCH` for reproducible images.
pub(super) fn created_now() -> String {
    let t = std::env::var("SOURCE_DATE_EPOCH")
        .ok()
        .and_then(|s| s.parse::<i64>().ok())
        .and_then(|s| time::OffsetDateTime::from_unix_timestamp(s).ok())
        .unwrap_or_else(time::OffsetDateTime::now_utc);
    t.replace_nanosecond(0).unwrap_or(t).format(&time::format_description::well_known::Rfc3339).unwrap_or_else(|_| "1970-01-01T00:00:00Z".into())
}
