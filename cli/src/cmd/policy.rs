//! Glue between the commands that restore images and the `sign` crate: the `--policy` flag
//! group (pull, unpack, copy, verify, lazy), where the policy file is found, the
//! signature stores over a registry client and a layout, and the one check that runs
//! before an image is used.
//!
//! The policy is found as containers tools find theirs: `--policy FILE` (or
//! `$SNAPCTL_POLICY`), else `$HOME/.config/containers/policy.json`, else
//! `/etc/containers/policy.json`. With none of them every image is accepted, as before
//! signatures existed (skopeo and podman refuse to run without a policy file instead;
//! snapctl keeps working for its users who have never written one). Only a file that is
//! plainly not there counts as none: one that cannot be looked at (a dangling symlink, a
//! symlink loop, a directory that may not be searched) is an error, never "accept".
//! `--insecure-policy` ignores every file.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context as _;
use imgfmt::reference::{Reference, Selector};
use imgfmt::{BlobSource, Descriptor, FormatError, Image, OciDigest, OciLayout};
use pusher::referrers::Origin;
use regclient::RegistrySource;

use super::common::{self, Opened};

/// Which images may be restored (shared by pull, unpack, copy, verify and lazy).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct PolicyFlags {
    /// containers-policy.json deciding which images may be used, as skopeo and podman read
    /// it (e.g. sigstoreSigned: only images with a cosign signature by a given key; see
    /// `snapctl sign --help`). Checked before anything is written, cached or served;
    /// a refusal exits 1 naming the rule. [default: $SNAPCTL_POLICY, else
    /// ~/.config/containers/policy.json, else /etc/containers/policy.json; with none of
    /// them every image is accepted; one there that cannot be read is an error]
    #[arg(long, value_name = "FILE", env = "SNAPCTL_POLICY")]
    pub policy: Option<PathBuf>,
    /// Consult no policy file at all (skopeo's --insecure-policy).
    #[arg(long, conflicts_with = "policy")]
    pub insecure_policy: bool,
}

/// The policy refused an image (exit 1).
#[derive(Debug)]
pub struct PolicyRefused(pub String);
impl std::fmt::Display for PolicyRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}
impl std::error::Error for PolicyRefused {}

/// Where the policy is looked for when `--policy` is not given, in containers tools' order.
fn default_policy_candidates() -> Vec<PathBuf> {
    let user = std::env::var_os("HOME").map(|h| Path::new(&h).join(".config/containers/policy.json"));
    user.into_iter().chain([PathBuf::from("/etc/containers/policy.json")]).collect()
}

/// The first of `candidates` that exists. Only a file that is plainly not there (no such
/// file or directory, with no dangling symlink on the way) means "look at the next one";
/// a candidate that cannot be looked at (a dangling symlink, a symlink loop, a path
/// component that is not a directory, a directory that may not be searched) is an error,
/// never "no policy": a policy that cannot be read must not let every image through.
pub fn find_policy(candidates: &[PathBuf]) -> anyhow::Result<Option<PathBuf>> {
    for p in candidates {
        match std::fs::metadata(p) {
            Ok(_) => return Ok(Some(p.clone())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if let Some(link) = dangling_symlink(p) {
                    let to = std::fs::read_link(&link).map(|t| t.display().to_string()).unwrap_or_else(|_| "?".into());
                    anyhow::bail!(
                        "policy {}: {} is a symlink to {to}, which does not exist; fix or remove the link, \
                         or name a policy with --policy (--insecure-policy to consult none)",
                        p.display(),
                        link.display()
                    );
                }
            }
            Err(e) => anyhow::bail!(
                "policy {}: cannot be read ({e}); make it readable or remove it, \
                 or name a policy with --policy (--insecure-policy to consult none)",
                p.display()
            ),
        }
    }
    Ok(None)
}

/// The first component of `p` (itself or a parent) that is a symlink to nothing, if any.
fn dangling_symlink(p: &Path) -> Option<PathBuf> {
    let mut prefixes: Vec<&Path> = p.ancestors().collect();
    prefixes.reverse();
    for prefix in prefixes {
        match std::fs::symlink_metadata(prefix) {
            Ok(m) if m.file_type().is_symlink() && std::fs::metadata(prefix).is_err() => return Some(prefix.into()),
            Ok(_) => {}
            Err(_) => return None,
        }
    }
    None
}

impl PolicyFlags {
    /// The policy in force, if any (a file named but absent or invalid is an error).
    pub fn load(&self) -> anyhow::Result<Option<sign::Policy>> {
        if self.insecure_policy {
            return Ok(None);
        }
        let found = match &self.policy {
            Some(p) => Some(p.clone()),
            None => find_policy(&default_policy_candidates())?,
        };
        let Some(path) = found else {
            tracing::debug!("no policy file: every image is accepted");
            return Ok(None);
        };
        Ok(Some(sign::Policy::from_file(&path)?))
    }

    /// Open `reference` and its image, the image's metadata read while the policy reads
    /// its signatures; the image is returned only if the policy accepts it. The returned
    /// `Opened` names the image by its digest (what was checked is what is used).
    pub fn open_image(&self, reference: &str, plain_http: bool) -> anyhow::Result<(Opened, Image)> {
        let r: Reference = reference.parse()?;
        let (mut o, store) = open_with_store(&r, reference, plain_http)?;
        let image = self.gate(&r, store.as_ref(), &mut o, common::open_image)?;
        Ok((o, image))
    }

    /// Check the image `o` names before `open` uses it: resolve its digest (and make `o`
    /// name it by digest), then run `open(o)` while the policy's signature reads go on
    /// beside it. `open`'s result is returned only once the policy has accepted the image.
    pub fn gate<T>(&self, r: &Reference, store: &dyn sign::Store, o: &mut Opened, open: impl FnOnce(&Opened) -> anyhow::Result<T>) -> anyhow::Result<T> {
        let Some(policy) = self.load()? else { return open(o) };
        let digest = resolve(o)?;
        o.selector = Selector::Digest(digest.clone());
        let identity = sign::ImageIdentity::of(r).map_err(|e| anyhow::anyhow!("{}: {e}", o.reference))?;
        let (checked, opened) = std::thread::scope(|s| {
            let check = s.spawn(|| sign::check(store, &policy, &identity, &digest));
            let opened = open(o);
            (check.join().expect("policy check thread"), opened)
        });
        accepted(checked, &o.reference)?;
        opened
    }

    /// Check the image `digest` that `reference` names (no overlap: `copy`).
    pub fn check(&self, reference: &str, digest: &OciDigest, plain_http: bool) -> anyhow::Result<()> {
        let Some(policy) = self.load()? else { return Ok(()) };
        let r: Reference = reference.parse()?;
        let (_, store) = open_with_store(&r, reference, plain_http)?;
        let identity = sign::ImageIdentity::of(&r).map_err(|e| anyhow::anyhow!("{reference}: {e}"))?;
        accepted(sign::check(store.as_ref(), &policy, &identity, digest), reference)
    }
}

/// The verdict as the CLI reports it: a note naming the signer on stderr, a refusal as
/// [`PolicyRefused`] (exit 1), a store that could not be read as an error (exit 2).
fn accepted(r: Result<sign::Accepted, sign::CheckError>, reference: &str) -> anyhow::Result<()> {
    match r {
        Ok(a) => {
            for s in &a.signatures {
                eprintln!(
                    "signature: {} signed by key {} as {} ({}; policy {})",
                    common::printable(reference),
                    s.key,
                    common::printable(&s.payload.docker_reference),
                    s.place,
                    a.rule
                );
            }
            Ok(())
        }
        Err(e @ sign::CheckError::Refused { .. }) => Err(anyhow::Error::new(PolicyRefused(e.to_string()))),
        Err(e) => Err(anyhow::Error::new(e)),
    }
}

fn resolve(o: &Opened) -> anyhow::Result<OciDigest> {
    Ok(match &o.selector {
        Selector::Tag(t) => o.source.resolve_tag(t).with_context(|| format!("resolving {}", o.reference))?,
        Selector::Digest(d) => d.clone(),
    })
}

/// An opened reference and a signature store over the same registry client (one
/// connection) or the same layout directory.
pub fn open_with_store(r: &Reference, reference: &str, plain_http: bool) -> anyhow::Result<(Opened, Box<dyn sign::Store>)> {
    open_with_store_and_origin(r, reference, plain_http).map(|(o, store, _)| (o, store))
}

/// [`open_with_store`], and the same client or directory as the origin its referrers are
/// listed at: a second client would log in and connect again.
pub fn open_with_store_and_origin(r: &Reference, reference: &str, plain_http: bool) -> anyhow::Result<(Opened, Box<dyn sign::Store>, Origin)> {
    Ok(match r {
        Reference::Layout { path, selector } => {
            let open = || OciLayout::open(path).with_context(|| format!("opening {reference}"));
            let opened = Opened { source: Box::new(open()?), selector: selector.clone(), reference: reference.into() };
            (opened, Box::new(LayoutStore(open()?)), Origin::Layout(open()?))
        }
        Reference::Registry { host, repository, selector } => {
            let c = Arc::new(common::registry_client(host, repository, plain_http)?);
            let opened = Opened { source: Box::new(c.clone()), selector: selector.clone(), reference: reference.into() };
            (opened, Box::new(RegistryStore(c.clone())), Origin::Registry(c))
        }
    })
}

/// Signatures in a registry repository: the tag scheme, and referrers (the API, else the
/// fallback tag).
pub struct RegistryStore(pub Arc<RegistrySource>);

impl sign::Store for RegistryStore {
    fn describe(&self) -> String {
        self.0.describe()
    }
    fn manifest_by_tag(&self, tag: &str, limit: u64) -> Result<Option<Vec<u8>>, FormatError> {
        self.0.get_manifest(tag, limit)
    }
    fn manifest(&self, digest: &OciDigest, limit: u64) -> Result<Vec<u8>, FormatError> {
        self.0.get_manifest(digest.as_str(), limit)?.ok_or_else(|| FormatError::BlobNotFound(digest.clone()))
    }
    fn blob(&self, digest: &OciDigest, limit: u64) -> Result<Vec<u8>, FormatError> {
        self.0.read_blob_unverified(digest, limit)
    }
    fn referrers(&self, subject: &OciDigest) -> Result<Vec<Descriptor>, FormatError> {
        self.0.list_referrers(subject, Some(sign::manifest::SIGNATURE_ARTIFACT_TYPE)).map_err(|e| e.into_source_error(self.0.host()))
    }
    fn put_blob(&self, data: &[u8]) -> Result<(), FormatError> {
        self.0.push_small_blob(data).map(|_| ()).map_err(|e| e.into_source_error(self.0.host()))
    }
    fn put_tagged_manifest(&self, tag: &str, bytes: &[u8]) -> Result<(), FormatError> {
        self.0.put_manifest(tag, bytes).map(|_| ()).map_err(|e| e.into_source_error(self.0.host()))
    }
    fn put_referrer(&self, subject: &OciDigest, bytes: &[u8]) -> Result<bool, FormatError> {
        if !self.0.has_referrers_api(subject)? {
            return Ok(false);
        }
        let put = self.0.put_manifest(OciDigest::of(bytes).as_str(), bytes).map_err(|e| e.into_source_error(self.0.host()))?;
        Ok(put.subject_indexed)
    }
}

/// Signatures in a layout: the tag scheme only (a layout has no referrers API).
pub struct LayoutStore(pub OciLayout);

impl sign::Store for LayoutStore {
    fn describe(&self) -> String {
        self.0.describe()
    }
    fn manifest_by_tag(&self, tag: &str, limit: u64) -> Result<Option<Vec<u8>>, FormatError> {
        match self.0.resolve_tag(tag) {
            Ok(d) => self.0.read_blob_unverified(&d, limit).map(Some),
            Err(FormatError::TagNotFound { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }
    fn manifest(&self, digest: &OciDigest, limit: u64) -> Result<Vec<u8>, FormatError> {
        self.0.read_blob_unverified(digest, limit)
    }
    fn blob(&self, digest: &OciDigest, limit: u64) -> Result<Vec<u8>, FormatError> {
        self.0.read_blob_unverified(digest, limit)
    }
    fn referrers(&self, _: &OciDigest) -> Result<Vec<Descriptor>, FormatError> {
        Ok(Vec::new())
    }
    fn put_blob(&self, data: &[u8]) -> Result<(), FormatError> {
        self.0.put_blob(data).map(|_| ())
    }
    fn put_tagged_manifest(&self, tag: &str, bytes: &[u8]) -> Result<(), FormatError> {
        let d = self.0.put_blob(bytes)?;
        self.0.set_tag(tag, Descriptor::new(imgfmt::media::OCI_MANIFEST, d, bytes.len() as u64))
    }
    fn put_referrer(&self, _: &OciDigest, _: &[u8]) -> Result<bool, FormatError> {
        Ok(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two candidates in a scratch directory, as `$HOME`'s and `/etc`'s would be; the second
    /// holds a policy, so "the first is absent" and "the first could not be read" differ.
    fn candidates(dir: &Path) -> Vec<PathBuf> {
        let system = dir.join("etc/containers/policy.json");
        std::fs::create_dir_all(system.parent().unwrap()).unwrap();
        std::fs::write(&system, r#"{"default":[{"type":"reject"}]}"#).unwrap();
        vec![dir.join("home/.config/containers/policy.json"), system]
    }

    fn refused(c: &[PathBuf], says: &str) {
        let e = find_policy(c).expect_err("a policy that cannot be read was taken as absent");
        let m = format!("{e:#}");
        assert!(m.contains(&c[0].display().to_string()) && m.contains(says) && m.contains("--policy"), "{m}");
    }

    #[test]
    fn absent_candidates_are_skipped_and_none_at_all_is_no_policy() {
        let d = tempfile::tempdir().unwrap();
        let c = candidates(d.path());
        assert_eq!(find_policy(&c).unwrap(), Some(c[1].clone()));
        std::fs::remove_file(&c[1]).unwrap();
        assert_eq!(find_policy(&c).unwrap(), None);
    }

    /// A dangling symlink (the file itself, or a directory on its path) is stat's ENOENT,
    /// but it says a policy was meant to be there: an error, never the next candidate.
    #[test]
    fn regression_issue_35_a_dangling_symlink_policy_is_an_error_not_no_policy() {
        let d = tempfile::tempdir().unwrap();
        let c = candidates(d.path());
        std::fs::create_dir_all(c[0].parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(d.path().join("gone.json"), &c[0]).unwrap();
        refused(&c, "does not exist");
        std::fs::remove_file(&c[0]).unwrap();
        std::fs::remove_dir(c[0].parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(d.path().join("gone-dir"), c[0].parent().unwrap()).unwrap();
        refused(&c, "does not exist");
    }

    /// A directory on the path that may not be searched is EACCES for a user; root searches
    /// every directory, so the test uses what fails for root too: a path component that is
    /// a regular file (ENOTDIR) and a symlink loop (ELOOP). All three are the same branch:
    /// any stat error but ENOENT.
    #[test]
    fn regression_issue_35_a_policy_path_that_cannot_be_looked_at_is_an_error() {
        let d = tempfile::tempdir().unwrap();
        let c = candidates(d.path());
        let containers = c[0].parent().unwrap();
        std::fs::create_dir_all(containers.parent().unwrap()).unwrap();
        std::fs::write(containers, b"not a directory").unwrap();
        refused(&c, "cannot be read");
        std::fs::remove_file(containers).unwrap();
        std::fs::create_dir(containers).unwrap();
        std::os::unix::fs::symlink(&c[0], &c[0]).unwrap();
        refused(&c, "cannot be read");
    }
}
