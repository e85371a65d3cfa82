//! `snapctl delete`: a tag, or a manifest with its tags, from a registry or a layout.

use std::process::ExitCode;

use anyhow::{bail, Context};
use imgfmt::reference::{Reference, Selector};
use imgfmt::{media, ImageConfig, ImageStore, Manifest, OciDigest};

use super::common::{self, RegistryFlags};

/// Delete a tag, or an image manifest and every tag naming it.
///
/// REF:TAG removes the tag alone; the image stays (reachable by digest, and by its other
/// tags) until gc finds nothing keeping it. REF@DIGEST removes the manifest and every tag
/// naming it; the blobs it lists stay for gc (other images may share them). In a layout,
/// the manifest's blob is removed with its entries in index.json.
///
/// A manifest that another tagged image in the same repository or layout is built on
/// (names as its parent or base) is refused, listing those images, unless --force: a
/// layer whose parent is gone cannot be pulled. A registry that does not allow deleting
/// (distribution without storage.delete.enabled answers 405 UNSUPPORTED) is reported as
/// such (exit 2).
///
/// Examples:
///   snapctl delete 127.0.0.1:5000/vm/base:old
///   snapctl delete 127.0.0.1:5000/vm/base@sha256:...
///   snapctl delete oci:./images:vm1
#[derive(Debug, clap::Args)]
#[command(verbatim_doc_comment)]
pub struct DeleteArgs {
    /// What to delete: oci:PATH:TAG, oci:PATH@DIGEST, HOST[:PORT]/REPO:TAG or
    /// HOST[:PORT]/REPO@DIGEST.
    pub reference: String,
    /// Delete a manifest even when other tagged images are built on it.
    #[arg(long)]
    pub force: bool,
    #[command(flatten)]
    pub registry: RegistryFlags,
}

pub fn run(a: DeleteArgs) -> anyhow::Result<ExitCode> {
    let r: Reference = a.reference.parse()?;
    if !explicit_selector(&a.reference) {
        bail!("{}: name the tag (:TAG) or the manifest (@DIGEST) to delete", a.reference);
    }
    let o = common::open_parsed(&r, &a.reference)?;
    let store = o.source.as_ref();
    if let Selector::Digest(d) = &o.selector {
        let dependents = dependents(store, d).with_context(|| format!("checking what is built on {d}"))?;
        if !dependents.is_empty() && !a.force {
            bail!("{}: {} (delete those first, or pass --force)", a.reference, dependents.join(", "));
        }
    }
    store.delete(&o.selector).map_err(|e| refused(e, &r))?;
    match &o.selector {
        Selector::Tag(t) => eprintln!("deleted tag {t} of {}", r.store_name()),
        Selector::Digest(d) => eprintln!("deleted manifest {d} of {} with its tags", r.store_name()),
    }
    Ok(common::code(common::EXIT_OK))
}

/// Whether `reference` names its tag or digest itself (not the default `latest`: deleting
/// is not a command to guess for).
fn explicit_selector(reference: &str) -> bool {
    let last = reference.rsplit('/').next().unwrap_or(reference);
    last.contains('@') || (last.contains(':') && reference.strip_prefix("oci:").is_none_or(|p| p.contains(':')))
}

/// A deletion the store refused, said plainly when the registry refuses every deletion.
fn refused(e: imgfmt::FormatError, r: &Reference) -> anyhow::Error {
    if regclient::refuses_deletes(&e) {
        let host = r.host().unwrap_or("the registry");
        return anyhow::Error::new(e)
            .context(format!("{host} does not allow deleting (it answered DELETE with UNSUPPORTED; distribution needs storage.delete.enabled: true)"));
    }
    anyhow::Error::new(e).context(format!("deleting {r}"))
}

/// The tagged images of `store` (other than `victim`'s own tags) that name `victim` as
/// their parent or base, as `TAG (parent)`.
fn dependents(store: &dyn ImageStore, victim: &OciDigest) -> anyhow::Result<Vec<String>> {
    let mut out = Vec::new();
    for tag in store.tags()? {
        let Some(bytes) = store.manifest_by_tag(&tag, imgfmt::manifest::MAX_MANIFEST_BYTES)? else { continue };
        if OciDigest::of(&bytes) == *victim {
            continue;
        }
        let Ok(m) = Manifest::decode(&bytes) else { continue };
        if m.config.media_type != media::CONFIG {
            continue;
        }
        let config = store.read_blob_unverified(&m.config.digest, imgfmt::config::MAX_CONFIG_BYTES)?;
        if OciDigest::of(&config) != m.config.digest {
            bail!("the config of {tag} does not hash to {}", m.config.digest);
        }
        let Ok(c) = ImageConfig::decode(&config) else { continue };
        for (what, link) in [("parent", &c.parent), ("base", &c.base)] {
            if link.as_ref().is_some_and(|l| l.manifest == *victim) {
                out.push(format!("{} has it as its {what}", common::printable(&tag)));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::explicit_selector;

    #[test]
    fn a_deletion_names_its_tag_or_digest() {
        for yes in ["h:5000/r:v1", "h/r@sha256:00", "oci:./l:v1", "oci:/x/l@sha256:00", "h:5000/a/b:t"] {
            assert!(explicit_selector(yes), "{yes}");
        }
        for no in ["h:5000/r", "oci:./l", "h/a/b", "oci:/x/l"] {
            assert!(!explicit_selector(no), "{no}");
        }
    }
}
