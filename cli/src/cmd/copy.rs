//! `snapctl copy`: an image from any store to any store (registry or local layout),
//! keeping its digest.

use std::process::ExitCode;

use anyhow::{bail, Context};
use imgfmt::reference::{Reference, Selector};
use imgfmt::OciLayout;

use super::common::{self, open_ref_plain, registry_client};
use super::push::{transfer, TransferFlags};

/// Copy an image between registries and local layouts, keeping its digest.
///
/// The manifest's bytes are copied as they are, so the digest is the same at both ends;
/// every blob is streamed and checked against its digest before the destination commits
/// it (a registry's final PUT, a layout's rename). Blobs the destination has are skipped;
/// into a registry, blobs are mounted and uploads resume exactly as with `push`.
///
/// Examples:
///   snapctl copy oci:./images:vm1 registry.example.com/vm/base:v1
///   snapctl copy registry.example.com/vm/base:v1 oci:./backup:vm1
///   snapctl copy 127.0.0.1:5000/vm/base@sha256:... 127.0.0.1:5001/mirror/base:v1
///   snapctl copy oci:./a:vm1 oci:./b:vm1
#[derive(Debug, clap::Args)]
#[command(verbatim_doc_comment)]
pub struct CopyArgs {
    /// Source: oci:PATH[:TAG|@DIGEST] or HOST[:PORT]/REPO[:TAG|@DIGEST].
    pub src: String,
    /// Destination: oci:PATH[:TAG] or HOST[:PORT]/REPO[:TAG] (TAG defaults to "latest";
    /// @DIGEST stores by digest only, and must match the source).
    pub dest: String,
    #[command(flatten)]
    pub transfer: TransferFlags,
    #[command(flatten)]
    pub policy: super::policy::PolicyFlags,
}

pub fn run(a: CopyArgs) -> anyhow::Result<ExitCode> {
    copy_refs(&a.src, &a.dest, &a.transfer, &a.policy)?;
    Ok(common::code(common::EXIT_OK))
}

/// Copy the image `src` names to `dest` (both references as the CLI takes them). Also
/// what `snapctl pull REF oci:PATH:TAG` does. The policy is checked before anything is
/// written.
pub fn copy_refs(src: &str, dest: &str, flags: &TransferFlags, policy: &super::policy::PolicyFlags) -> anyhow::Result<pusher::PushReport> {
    let opened = open_ref_plain(src, flags.registry.plain_http)?;
    let digest = match &opened.selector {
        Selector::Tag(t) => opened.source.resolve_tag(t).with_context(|| format!("resolving {src}"))?,
        Selector::Digest(d) => d.clone(),
    };
    policy.check(src, &digest, flags.registry.plain_http)?;
    let (tag, by_digest) = match dest.parse::<Reference>()? {
        Reference::Layout { selector, .. } | Reference::Registry { selector, .. } => match selector {
            Selector::Tag(t) => (Some(t), None),
            Selector::Digest(d) => (None, Some(d)),
        },
    };
    if let Some(d) = by_digest.filter(|d| d != &digest) {
        bail!("{dest}: names {d}, but {src} is {digest} (copy keeps digests)");
    }
    // Remember that the source repository holds these blobs: a later push of a layer
    // over this image to that registry can mount them instead of uploading.
    if let Ok(Reference::Registry { host, repository, .. }) = src.parse::<Reference>() {
        if let Ok((_, m)) = pusher::copy::manifest_blobs(opened.source.as_ref(), &digest) {
            let known = regclient::KnownBlobs::new(&flags.cache_dir(), &host);
            known.record(&repository, std::iter::once(&m.config.digest).chain(m.layers.iter().map(|l| &l.digest)));
        }
    }
    match dest.parse::<Reference>()? {
        Reference::Layout { path, .. } => {
            let layout = OciLayout::open_or_create(&path).with_context(|| format!("opening layout {}", path.display()))?;
            transfer(opened.source.as_ref(), &digest, &pusher::Target::Layout(&layout), tag.as_deref(), flags, "copy")
        }
        Reference::Registry { host, repository, .. } => {
            let client = registry_client(&host, &repository, flags.registry.plain_http)?;
            let report = transfer(opened.source.as_ref(), &digest, &pusher::Target::Registry(&client), tag.as_deref(), flags, "copy")?;
            Ok(report)
        }
    }
}
