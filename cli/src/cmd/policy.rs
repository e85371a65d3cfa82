//! Glue between the commands that restore images and the `sign` crate: the `--policy` flag
//! group (pull, unpack, copy, verify, lazy), where the policy file is found, and the one
//! check that runs before an image is used (its signatures read from the image's own
//! store).
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

use imgfmt::reference::{Reference, Selector};
use imgfmt::{Image, OciDigest};

use super::common::{self, Opened, PolicyRefused};

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

    /// Open `reference` and its image to restore it (pull, unpack, mount: its reads are
    /// pulls), the image's metadata read while the policy reads its signatures; the image
    /// is returned only if the policy accepts it. The returned `Opened` names the image by
    /// its digest (what was checked is what is used).
    pub fn open_image(&self, reference: &str) -> anyhow::Result<(Opened, Image)> {
        let r: Reference = reference.parse()?;
        let mut o = common::open_to_restore(&r, reference)?;
        let image = self.gate(&r, &mut o, common::open_image)?;
        Ok((o, image))
    }

    /// Check the image `o` names before `open` uses it: resolve its digest (and make `o`
    /// name it by digest), then run `open(o)` while the policy's signature reads (in `o`'s
    /// store) go on beside it. `open`'s result is returned only once the policy has
    /// accepted the image.
    pub fn gate<T>(&self, r: &Reference, o: &mut Opened, open: impl FnOnce(&Opened) -> anyhow::Result<T>) -> anyhow::Result<T> {
        let Some(policy) = self.load()? else { return open(o) };
        let digest = common::resolve(o)?;
        o.selector = Selector::Digest(digest.clone());
        let identity = sign::ImageIdentity::of(r).map_err(|e| anyhow::anyhow!("{}: {e}", o.reference))?;
        let o: &Opened = o;
        let (checked, opened) = std::thread::scope(|s| {
            let check = s.spawn(|| sign::check(o.source.as_ref(), &policy, &identity, &digest));
            let opened = open(o);
            (check.join().expect("policy check thread"), opened)
        });
        accepted(checked, &o.reference)?;
        opened
    }

    /// Check the image `digest` that `o` (opened from `r`) names (no overlap: `copy`).
    pub fn check(&self, r: &Reference, o: &Opened, digest: &OciDigest) -> anyhow::Result<()> {
        let Some(policy) = self.load()? else { return Ok(()) };
        let identity = sign::ImageIdentity::of(r).map_err(|e| anyhow::anyhow!("{}: {e}", o.reference))?;
        accepted(sign::check(o.source.as_ref(), &policy, &identity, digest), &o.reference)
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
