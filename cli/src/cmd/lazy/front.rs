//! The CLI as `lazy`'s front end ([`lazy::wake::Front`]): its registry flags and
//! credentials, its messages and exit codes, and its policy's gate around the opening.

use std::sync::Arc;

use anyhow::{bail, Context as _};
use imgfmt::reference::{Reference, Selector};
use imgfmt::{BlobSource, Image, OciLayout, PendingOutboards, Role};
use lazy::wake;

use crate::cmd::common::{self, open_image};
use crate::cmd::policy::PolicyFlags;

pub struct Cli<'a> {
    /// The image, as the command line names it.
    pub image: &'a str,
    pub reference: &'a Reference,
    /// `--file`.
    pub file: Option<&'a str>,
    pub policy: &'a PolicyFlags,
}

impl wake::Front for Cli<'_> {
    type Error = anyhow::Error;

    fn layout(&self, path: &std::path::Path) -> anyhow::Result<OciLayout> {
        OciLayout::open(path).with_context(|| format!("opening {}", self.image))
    }

    fn registry(&self, host: &str, repository: &str) -> anyhow::Result<regclient::RegistrySource> {
        common::registry_client_to_restore(host, repository)
    }

    fn resolve(&self, source: &Arc<dyn BlobSource>, selector: &Selector) -> anyhow::Result<imgfmt::OciDigest> {
        common::resolve_in(source.as_ref(), selector, self.image)
    }

    fn open(&self, at: &wake::Opening<'_>) -> anyhow::Result<(Image, Option<PendingOutboards>)> {
        let src = at.store.metadata();
        let mut o =
            common::Opened { source: at.store.images(), registry: None, selector: Selector::Digest(at.digest.clone()), reference: self.image.to_string() };
        let r = self.reference;
        match at.outboards {
            None => self.policy.gate(r, &mut o, open_image).map(|image| (image, None)),
            Some(ahead) => {
                let (image, pending) = self.policy.gate(r, &mut o, |o| common::open_image_outboards_later(src.clone(), o, ahead))?;
                Ok((image, Some(pending)))
            }
        }
    }

    /// `--file`, else the image's one file with role memory.
    fn memory_file(&self, image: &Image) -> anyhow::Result<usize> {
        Ok(match self.file {
            Some(name) => image.file(name).with_context(|| format!("{}: no file named {name:?}", self.image))?.0,
            None => {
                let mem: Vec<usize> = image.files.iter().enumerate().filter(|(_, f)| f.role == Role::Memory).map(|(i, _)| i).collect();
                match mem.as_slice() {
                    [i] => *i,
                    [] => bail!("{}: no file has role memory; name one with --file", self.image),
                    _ => bail!("{}: several memory files; name one with --file", self.image),
                }
            }
        })
    }

    fn warn(message: &str) {
        tracing::warn!("{message}");
    }
}
