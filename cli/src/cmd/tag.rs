//! `snapctl tag`: another tag on an image, in the store it is in.

use std::process::ExitCode;

use anyhow::{bail, Context};
use imgfmt::OciDigest;

use super::common::{self, outln, RegistryFlags};

/// Tag an image again, where it is: no blob is read or written.
///
/// The manifest SRC names is stored under DEST_TAG in the same repository or layout,
/// byte for byte, so the new tag names the same digest. A tag DEST_TAG named already is
/// moved. Prints the manifest digest on stdout.
///
/// Examples:
///   snapctl tag 127.0.0.1:5000/vm/base:v1 stable
///   snapctl tag oci:./images@sha256:... vm1-golden
#[derive(Debug, clap::Args)]
#[command(verbatim_doc_comment)]
pub struct TagArgs {
    /// The image: oci:PATH[:TAG|@DIGEST] or HOST[:PORT]/REPO[:TAG|@DIGEST].
    pub src: String,
    /// The new tag, in SRC's repository or layout.
    pub dest_tag: String,
    #[command(flatten)]
    pub registry: RegistryFlags,
}

pub fn run(a: TagArgs) -> anyhow::Result<ExitCode> {
    imgfmt::layout::check_tag(&a.dest_tag)?;
    let o = common::open_ref(&a.src)?;
    let digest = common::resolve(&o)?;
    let bytes = o.source.manifest(&digest, imgfmt::manifest::MAX_MANIFEST_BYTES).with_context(|| format!("reading manifest {digest} of {}", a.src))?;
    let actual = OciDigest::of(&bytes);
    if actual != digest {
        bail!("{}: manifest {digest} hashes to {actual}; not tagging it", a.src);
    }
    o.source.put_tagged_manifest(&a.dest_tag, &bytes).with_context(|| format!("tagging {digest} as {}", a.dest_tag))?;
    eprintln!("tagged {digest} as {}", a.dest_tag);
    outln!("{digest}")?;
    Ok(common::code(common::EXIT_OK))
}
