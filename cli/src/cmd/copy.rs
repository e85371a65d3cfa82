//! `snapctl copy`: an image from any store to any store (registry or local layout),
//! keeping its digest.

use std::process::ExitCode;

use anyhow::{bail, Context};
use imgfmt::reference::{Reference, Selector};
use imgfmt::OciLayout;

use super::common::{self, registry_client};
use super::push::{transfer_then, TransferFlags};

/// Copy an image between registries and local layouts, keeping its digest, with what is
/// attached to it.
///
/// The manifest's bytes are copied as they are, so the digest is the same at both ends;
/// every blob is streamed and checked against its digest before the destination commits
/// it (a registry's final PUT, a layout's rename). Blobs the destination has are skipped;
/// into a registry, blobs are mounted and uploads resume exactly as with `push`.
///
/// What is attached to the image comes too (--no-referrers: not): its OCI 1.1 referrers
/// (signatures, SBOMs, snapctl's recorded traces with their working sets), listed by the
/// source's referrers API or fallback tag, and tags named after it (cosign's
/// sha256-<hex>.sig, .att, .sbom), and what is attached to those. At a destination without
/// the referrers API (distribution 2.8) the referrers are listed in the fallback index.
/// `snapctl inspect` lists them. A sha256-<hex>.sig the destination has already keeps its
/// signatures: the source's are added to it, as `snapctl sign` adds one. --sign-key signs
/// the copy at a registry destination in the same step.
///
/// Examples:
///   snapctl copy oci:./images:vm1 registry.example.com/vm/base:v1
///   snapctl copy registry.example.com/vm/base:v1 oci:./backup:vm1
///   snapctl copy 127.0.0.1:5000/vm/base@sha256:... 127.0.0.1:5001/mirror/base:v1
///   snapctl copy oci:./a:vm1 oci:./b:vm1
///   snapctl copy oci:./images:vm1 registry.example.com/vm/base:v1 --sign-key cosign.key
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
    /// Copy the image alone: no referrers, no cosign signature tags.
    #[arg(long)]
    pub no_referrers: bool,
    #[command(flatten)]
    pub policy: super::policy::PolicyFlags,
}

pub fn run(a: CopyArgs) -> anyhow::Result<ExitCode> {
    copy_image(&a.src, &a.dest, &a.transfer, &a.policy, !a.no_referrers)?;
    Ok(common::code(common::EXIT_OK))
}

/// Copy the image `src` names to `dest` (both references as the CLI takes them), without
/// its referrers: what `snapctl pull REF oci:PATH:TAG` does. The policy is checked before
/// anything is written.
pub fn copy_refs(src: &str, dest: &str, flags: &TransferFlags, policy: &super::policy::PolicyFlags) -> anyhow::Result<pusher::PushReport> {
    copy_image(src, dest, flags, policy, false)
}

/// [`copy_refs`], carrying what is attached to the image when `referrers`.
pub fn copy_image(src: &str, dest: &str, flags: &TransferFlags, policy: &super::policy::PolicyFlags, referrers: bool) -> anyhow::Result<pusher::PushReport> {
    let r: Reference = src.parse()?;
    let o = common::open_to_restore(&r, src)?;
    let source = o.source.as_ref();
    let digest = common::resolve(&o)?;
    policy.check(&r, &o, &digest)?;
    let to: Reference = dest.parse()?;
    if flags.sign_key.is_some() && to.layout_path().is_some() {
        bail!("{}", super::push::NO_NAME_TO_SIGN);
    }
    let (tag, by_digest) = match to.selector() {
        Selector::Tag(t) => (Some(t.clone()), None),
        Selector::Digest(d) => (None, Some(d.clone())),
    };
    if let Some(d) = by_digest.filter(|d| d != &digest) {
        bail!("{dest}: names {d}, but {src} is {digest} (copy keeps digests)");
    }
    // Remember that the source repository holds these blobs: a later push of a layer
    // over this image to that registry can mount them instead of uploading.
    if let Some(c) = &o.registry {
        if let Ok((_, m)) = pusher::copy::manifest_blobs(source, &digest) {
            let known = regclient::KnownBlobs::new(&flags.cache_dir(), c.host());
            known.record(c.repository(), std::iter::once(&m.config.digest).chain(m.layers.iter().map(|l| &l.digest)));
        }
    }
    // What is attached goes after the image, before the report is printed.
    let carry = |target: &pusher::Target, opts: &pusher::CopyOptions, report: &mut pusher::PushReport| -> Result<(), pusher::CopyError> {
        if referrers {
            report.referrers = pusher::referrers::copy_attached(source, &digest, target, opts)?;
            if !report.referrers.is_empty() && !flags.json {
                eprintln!("copy: {} referrer(s) and signature tag(s) carried with {digest}", report.referrers.len());
            }
        }
        Ok(())
    };
    match (to.layout_path(), to.registry()) {
        (Some(path), _) => {
            let layout = OciLayout::open_or_create(path).with_context(|| format!("opening layout {}", path.display()))?;
            let target = pusher::Target::Layout(&layout);
            transfer_then(source, &digest, &target, tag.as_deref(), flags, "copy", |o, r| carry(&target, o, r))
        }
        (None, Some((host, repository))) => {
            let client = registry_client(host, repository)?;
            let target = pusher::Target::Registry(&client);
            transfer_then(source, &digest, &target, tag.as_deref(), flags, "copy", |o, r| carry(&target, o, r))
        }
        (None, None) => unreachable!("a reference names a layout or a registry"),
    }
}
