//! Push: an image in any [`BlobSource`] (usually a local layout) goes to a repository of
//! an OCI registry. Blobs the registry has are skipped (HEAD), blobs other repositories of
//! the same registry hold are cross-mounted (`--mount-from`, and the local record of
//! where blobs were pushed to or pulled from), the rest are uploaded in parallel, large
//! ones in resumable pieces; then the manifest is PUT under the tag.

use imgfmt::{BlobSource, OciDigest};
use regclient::RegistrySource;

use crate::copy::{copy, CopyError, CopyOptions, PushReport, Target};

/// Push manifest `digest` of `src`, with all its blobs, to `dest`'s repository as `tag`.
pub fn push(src: &dyn BlobSource, digest: &OciDigest, dest: &RegistrySource, tag: &str, opts: &CopyOptions) -> Result<PushReport, CopyError> {
    imgfmt::layout::check_tag(tag)?;
    copy(src, digest, &Target::Registry(dest), Some(tag), opts)
}
