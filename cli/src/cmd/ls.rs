//! `snapctl ls`: what a registry or a layout holds: repositories (the registry's catalog),
//! or the tags of a repository or layout with what each names.

use std::process::ExitCode;

use anyhow::Context;
use imgfmt::reference::Reference;
use imgfmt::{ImageStore, Manifest, OciDigest};

use super::common::{self, outln, RegistryFlags};

/// List repositories, or tags with their images.
///
/// `snapctl ls HOST[:PORT]` lists the registry's repositories (GET /v2/_catalog, every
/// page; only those the registry shows this client). `snapctl ls HOST[:PORT]/REPO` or
/// `snapctl ls oci:PATH` lists tags, one line each: tag, manifest digest, size (the
/// manifest's config and layers: what a pull of it reads at most), signed (a cosign
/// `sha256-<hex>.sig` tag or a signature referrer exists), created (the manifest's
/// org.opencontainers.image.created). Tags named after an image (`sha256-<hex>`,
/// `.sig`, `.att`, `.sbom`: referrers and signatures) are left out unless --all.
///
/// Examples:
///   snapctl ls 127.0.0.1:5000
///   snapctl ls registry.example.com/vm/base --json
///   snapctl ls oci:./images
#[derive(Debug, clap::Args)]
#[command(verbatim_doc_comment)]
pub struct LsArgs {
    /// HOST[:PORT] (its repositories), HOST[:PORT]/REPO or oci:PATH (its tags).
    pub target: String,
    /// Print JSON on stdout: {"repositories": [...]} or {"tags": [{tag, digest, size,
    /// signed, created}]}.
    #[arg(long)]
    pub json: bool,
    /// Also list the tags that name referrers and signatures (sha256-<hex>[.sig|.att|.sbom]).
    #[arg(long)]
    pub all: bool,
    #[command(flatten)]
    pub registry: RegistryFlags,
}

/// One tag of a listing.
#[derive(Debug, serde::Serialize)]
struct TagRow {
    tag: String,
    digest: OciDigest,
    /// Config and layers, in bytes; `None` for a manifest that is not an image manifest.
    size: Option<u64>,
    signed: bool,
    created: Option<String>,
}

pub fn run(a: LsArgs) -> anyhow::Result<ExitCode> {
    let target = a.target.strip_prefix(imgfmt::reference::DOCKER_TRANSPORT).unwrap_or(&a.target).trim_end_matches('/');
    if !target.starts_with("oci:") && !target.contains('/') {
        return list_repositories(target, a.json);
    }
    let r: Reference = target.parse()?;
    let o = common::open_parsed(&r, target)?;
    let store = o.source.as_ref();
    let tags = store.tags().with_context(|| format!("listing the tags of {}", r.store_name()))?;
    let mut rows = Vec::new();
    for tag in tags.iter().filter(|t| a.all || !is_attached_tag(t)) {
        if let Some(row) = tag_row(store, &tags, tag)? {
            rows.push(row);
        }
    }
    if a.json {
        common::print_json(&serde_json::json!({ "tags": rows }))?;
        return Ok(common::code(common::EXIT_OK));
    }
    let width = rows.iter().map(|r| r.tag.len()).max().unwrap_or(3).max(3);
    outln!("{:width$}  {:71}  {:>10}  {:6}  CREATED", "TAG", "DIGEST", "SIZE", "SIGNED")?;
    for r in &rows {
        let size = r.size.map_or_else(|| "-".to_string(), imgfmt::size::human);
        let signed = if r.signed { "yes" } else { "no" };
        outln!(
            "{:width$}  {:71}  {size:>10}  {signed:6}  {}",
            common::printable(&r.tag),
            r.digest,
            r.created.as_deref().map_or("-".into(), common::printable)
        )?;
    }
    Ok(common::code(common::EXIT_OK))
}

/// The registry's repositories, one a line (or JSON).
fn list_repositories(host: &str, json: bool) -> anyhow::Result<ExitCode> {
    imgfmt::reference::check_host(host).map_err(|e| anyhow::anyhow!("{e} (expected HOST[:PORT], HOST[:PORT]/REPO or oci:PATH)"))?;
    // A client for the host; the catalog is the registry's, whatever repository it names.
    let c = common::registry_client(host, "library")?;
    let repos = c.catalog()?;
    if json {
        common::print_json(&serde_json::json!({ "repositories": repos }))?;
    } else {
        for r in &repos {
            outln!("{}", common::printable(r))?;
        }
    }
    Ok(common::code(common::EXIT_OK))
}

/// What `tag` names, or `None` when it went while the listing was read.
fn tag_row(store: &dyn ImageStore, tags: &[String], tag: &str) -> anyhow::Result<Option<TagRow>> {
    let Some(bytes) = store.manifest_by_tag(tag, imgfmt::manifest::MAX_MANIFEST_BYTES).with_context(|| format!("reading the manifest tagged {tag}"))? else {
        return Ok(None);
    };
    let digest = OciDigest::of(&bytes);
    let m = Manifest::decode(&bytes).ok();
    let size = m.as_ref().map(|m| m.config.size + m.layers.iter().map(|l| l.size).sum::<u64>());
    let created = m.as_ref().and_then(|m| m.annotations.get(imgfmt::media::ANN_CREATED).cloned());
    let signed = tags.iter().any(|t| *t == imgfmt::store::signature_tag(&digest))
        || !store.referrers(&digest, Some(sign::manifest::SIGNATURE_ARTIFACT_TYPE)).with_context(|| format!("listing the referrers of {tag}"))?.is_empty();
    Ok(Some(TagRow { tag: tag.to_string(), digest, size, signed, created }))
}

/// Whether `tag` is named after an image (`sha256-<hex>`, and cosign's `.sig`, `.att`,
/// `.sbom`): what is attached to an image, not an image.
fn is_attached_tag(tag: &str) -> bool {
    let Some(rest) = tag.strip_prefix("sha256-") else { return false };
    let hex = rest.split_once('.').map_or(rest, |(h, _)| h);
    hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit())
}

#[cfg(test)]
mod tests {
    use super::is_attached_tag;

    #[test]
    fn tags_named_after_an_image_are_attached_ones() {
        let hex = "a".repeat(64);
        for t in [format!("sha256-{hex}"), format!("sha256-{hex}.sig"), format!("sha256-{hex}.att")] {
            assert!(is_attached_tag(&t), "{t}");
        }
        for t in ["v1", "sha256-abc", "latest", "sha256-"] {
            assert!(!is_attached_tag(t), "{t}");
        }
    }
}
