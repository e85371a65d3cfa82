//! Storage keys: where each kind of object lives in a [`crate::BlobStore`].
//!
//! ```text
//! blobs/<alg>/<hex[0..2]>/<hex>                          blob or manifest bytes (content-addressed, shared)
//! repositories/<name>/_layers/<alg>/<hex>                empty: blob is part of <name>
//! repositories/<name>/_manifests/<alg>/<hex>             manifest is in <name>; content = its media type
//! repositories/<name>/_tags/<tag>                        content = digest string
//! repositories/<name>/_referrers/<alg>/<subject-hex>/<alg>-<hex>   descriptor JSON of a referrer
//! repositories/<name>/_pulled                             JSON {digest: unix seconds}: last pulls
//! repositories/<name>/_leases/<alg>/<hex>                 JSON {"seconds": n}: a restore's lease on
//!                                                         the manifest, from the object's mtime
//! _uploads/<id>/state.json                               upload session: {repo, started}
//! _uploads/<id>/parts/<offset, 20 digits>                committed chunk starting at offset
//!                                                         (object stores)
//! _uploads/<id>/data                                      the bytes so far (local fs store;
//!                                                         may run past the committed size)
//! _uploads/<id>/committed                                 committed size, decimal (local fs)
//! _gc/run                                                 a gc is running (refreshed while it runs)
//! _gc/used/<alg>/<hex[0..2]>/<hex>                        empty; mtime: a request last relied on the blob
//! _gc/condemned/<alg>/<hex>                               empty: gc is deciding whether to delete the blob
//! _gc/inflight/<id>                                       JSON digests (and "tag:<name>:<tag>") a manifest PUT
//!                                                         in flight relies on
//! _gc/retiring/<name>/_tags/<tag>                         empty: gc is deciding whether to delete the tag
//! _gc/last                                                empty; mtime: when the last gc run finished
//! _catalog/<name, '/' written '!'>                        empty: repository <name> has held a manifest
//! _catalog.built                                          empty: _catalog/ names every such repository
//! ```
//! The `_gc/` objects are how live requests and a running gc agree on what may be
//! deleted ([`crate::inuse`]).
//! Names and tags are validated ([`crate::name`]) and cannot start with `_`, so a
//! repository component can never collide with `_layers`, `_tags`, ... .

use imgfmt::OciDigest;

use crate::name::{RepoName, Tag};

/// Prefix of all content-addressed bytes.
pub const BLOBS: &str = "blobs/";
/// Prefix of all repositories.
pub const REPOS: &str = "repositories/";
/// Prefix of all upload sessions.
pub const UPLOADS: &str = "_uploads/";

/// Prefix of gc's coordination objects.
pub const GC: &str = "_gc/";
/// Present while a gc runs; its mtime is refreshed as it goes.
pub const GC_RUN: &str = "_gc/run";
/// Prefix of the "a request relied on this blob" marks.
pub const GC_USED: &str = "_gc/used/";
/// Prefix of the "gc is deciding about this blob" marks.
pub const GC_CONDEMNED: &str = "_gc/condemned/";
/// Prefix of the leases of manifest PUTs in flight.
pub const GC_INFLIGHT: &str = "_gc/inflight/";
/// Prefix of the "gc is deciding about this tag" marks.
pub const GC_RETIRING: &str = "_gc/retiring/";
/// Written when a gc run finishes (its mtime schedules the next run in `serve`).
pub const GC_LAST: &str = "_gc/last";

/// The mark gc leaves on tag `t` of `repo` while it decides whether to delete it.
pub fn gc_retiring_tag(repo: &RepoName, t: &Tag) -> String {
    format!("{GC_RETIRING}{repo}/_tags/{t}")
}

/// A repository's last pull times (JSON: manifest digest → unix seconds).
pub fn pulled(repo: &RepoName) -> String {
    format!("repositories/{repo}/_pulled")
}

/// A restore's lease on manifest `d` of `repo` ([`crate::restore_lease`]).
pub fn restore_lease(repo: &RepoName, d: &OciDigest) -> String {
    format!("repositories/{repo}/_leases/{}/{}", d.algorithm(), d.hex())
}

/// Directory of the restore leases of `repo`.
pub fn restore_leases_dir(repo: &RepoName) -> String {
    format!("repositories/{repo}/_leases/")
}

/// The mark a request leaves on blob `d` it relies on.
pub fn gc_used(d: &OciDigest) -> String {
    format!("{GC_USED}{}/{}/{}", d.algorithm(), &d.hex()[..2], d.hex())
}

/// The digest of a [`gc_used`] key, if it is one.
pub fn parse_gc_used(key: &str) -> Option<OciDigest> {
    let mut it = key.strip_prefix(GC_USED)?.split('/');
    let (alg, _, hex) = (it.next()?, it.next()?, it.next()?);
    if it.next().is_some() {
        return None;
    }
    format!("{alg}:{hex}").parse().ok()
}

/// The mark gc leaves on blob `d` while it decides whether to delete it.
pub fn gc_condemned(d: &OciDigest) -> String {
    format!("{GC_CONDEMNED}{}/{}", d.algorithm(), d.hex())
}

/// The lease of manifest PUT `id` (32 hex).
pub fn gc_inflight(id: &str) -> String {
    format!("{GC_INFLIGHT}{id}")
}

/// Key of a blob's (or manifest's) bytes.
pub fn blob(d: &OciDigest) -> String {
    format!("blobs/{}/{}/{}", d.algorithm(), &d.hex()[..2], d.hex())
}

/// The digest a `blobs/...` key stores, if it is one.
pub fn parse_blob_key(key: &str) -> Option<OciDigest> {
    let mut it = key.split('/');
    let (b, alg, _, hex) = (it.next()?, it.next()?, it.next()?, it.next()?);
    if b != "blobs" || it.next().is_some() {
        return None;
    }
    format!("{alg}:{hex}").parse().ok()
}

/// Link saying blob `d` belongs to `repo`.
pub fn layer_link(repo: &RepoName, d: &OciDigest) -> String {
    format!("repositories/{repo}/_layers/{}/{}", d.algorithm(), d.hex())
}

/// Link saying manifest `d` is in `repo` (content: the manifest's media type).
pub fn manifest_link(repo: &RepoName, d: &OciDigest) -> String {
    format!("repositories/{repo}/_manifests/{}/{}", d.algorithm(), d.hex())
}

/// A tag (content: the digest it points at).
pub fn tag(repo: &RepoName, t: &Tag) -> String {
    format!("repositories/{repo}/_tags/{t}")
}

/// Directory of all tags of `repo`.
pub fn tags_dir(repo: &RepoName) -> String {
    format!("repositories/{repo}/_tags/")
}

/// Directory of all manifest links of `repo`.
pub fn manifests_dir(repo: &RepoName) -> String {
    format!("repositories/{repo}/_manifests/")
}

/// Directory of the referrers of `subject` in `repo`.
pub fn referrers_dir(repo: &RepoName, subject: &OciDigest) -> String {
    format!("repositories/{repo}/_referrers/{}/{}/", subject.algorithm(), subject.hex())
}

/// One referrer descriptor of `subject` in `repo`.
pub fn referrer(repo: &RepoName, subject: &OciDigest, d: &OciDigest) -> String {
    format!("{}{}-{}", referrers_dir(repo, subject), d.algorithm(), d.hex())
}

/// An upload session's state object.
pub fn upload_state(id: &str) -> String {
    format!("_uploads/{id}/state.json")
}

/// Directory of an upload session's committed chunks.
pub fn upload_parts(id: &str) -> String {
    format!("_uploads/{id}/parts/")
}

/// The bytes of upload `id` on a local store, appended in place.
pub fn upload_data(id: &str) -> String {
    format!("_uploads/{id}/data")
}

/// How many bytes of [`upload_data`] are committed (decimal text).
pub fn upload_committed(id: &str) -> String {
    format!("_uploads/{id}/committed")
}

/// The chunk of upload `id` starting at `offset`.
pub fn upload_part(id: &str, offset: u64) -> String {
    format!("_uploads/{id}/parts/{offset:020}")
}

/// Prefix of the catalog's entries ([`catalog_entry`]).
pub const CATALOG: &str = "_catalog/";
/// Present once `_catalog/` names every repository of the store (written by the first
/// server that indexed a store laid out before the catalog existed).
pub const CATALOG_BUILT: &str = "_catalog.built";

/// The catalog entry of `repo`: one flat key whose byte order is the catalog's order.
/// `/` becomes `!`, which sorts below every other character a name may hold, so a
/// repository sorts right after its parent path and before its siblings (`a`, `a/b`,
/// `a-b`), as distribution orders its catalog, on a directory and in S3 alike.
pub fn catalog_entry(repo: &RepoName) -> String {
    format!("{CATALOG}{}", catalog_position(repo.as_str()))
}

/// Where `name` (any text made of name characters, not necessarily a valid name: a
/// client's `last`) sorts in the catalog: the part of its entry key after [`CATALOG`].
pub fn catalog_position(name: &str) -> String {
    name.replace('/', "!")
}

/// The repository a [`catalog_entry`] key names, if it is one.
pub fn parse_catalog_entry(key: &str) -> Option<RepoName> {
    let rest = key.strip_prefix(CATALOG)?;
    if rest.contains('/') {
        return None;
    }
    RepoName::parse(&rest.replace('!', "/")).ok()
}

/// What a key under `repositories/` is, for listing-based walks (gc).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RepoKey {
    /// `_layers` link.
    Layer(RepoName, OciDigest),
    /// `_manifests` link.
    Manifest(RepoName, OciDigest),
    /// `_tags` entry.
    Tag(RepoName, Tag),
    /// `_referrers` entry: (repo, subject, referrer).
    Referrer(RepoName, OciDigest, OciDigest),
    /// `_pulled`: the repository's pull times.
    Pulled(RepoName),
    /// `_leases` entry: a restore's lease on a manifest.
    Lease(RepoName, OciDigest),
}

/// Classify a key under `repositories/`.
pub fn parse_repo_key(key: &str) -> Option<RepoKey> {
    let rest = key.strip_prefix(REPOS)?;
    let parts: Vec<&str> = rest.split('/').collect();
    let pos = parts.iter().position(|p| p.starts_with('_'))?;
    let repo = RepoName::parse(&parts[..pos].join("/")).ok()?;
    let tail = &parts[pos..];
    let dig = |a: &str, h: &str| format!("{a}:{h}").parse::<OciDigest>().ok();
    match tail {
        ["_layers", a, h] => Some(RepoKey::Layer(repo, dig(a, h)?)),
        ["_manifests", a, h] => Some(RepoKey::Manifest(repo, dig(a, h)?)),
        ["_tags", t] => Some(RepoKey::Tag(repo, Tag::parse(t).ok()?)),
        ["_pulled"] => Some(RepoKey::Pulled(repo)),
        ["_leases", a, h] => Some(RepoKey::Lease(repo, dig(a, h)?)),
        ["_referrers", a, h, r] => {
            let (ra, rh) = r.split_once('-')?;
            Some(RepoKey::Referrer(repo, dig(a, h)?, dig(ra, rh)?))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip() {
        let d = OciDigest::of(b"x");
        let s = imgfmt::OciHasher::sha512().finish_with(b"s");
        let r = RepoName::parse("a/b-c").unwrap();
        assert_eq!(parse_blob_key(&blob(&d)), Some(d.clone()));
        assert_eq!(parse_repo_key(&layer_link(&r, &d)), Some(RepoKey::Layer(r.clone(), d.clone())));
        assert_eq!(parse_repo_key(&manifest_link(&r, &d)), Some(RepoKey::Manifest(r.clone(), d.clone())));
        let t = Tag::parse("v1").unwrap();
        assert_eq!(parse_repo_key(&tag(&r, &t)), Some(RepoKey::Tag(r.clone(), t)));
        assert_eq!(parse_repo_key(&referrer(&r, &s, &d)), Some(RepoKey::Referrer(r.clone(), s.clone(), d)));
        assert_eq!(parse_repo_key("repositories/x/_bogus/1"), None);
        assert_eq!(parse_repo_key(&pulled(&r)), Some(RepoKey::Pulled(r.clone())));
        assert_eq!(parse_repo_key(&restore_lease(&r, &s)), Some(RepoKey::Lease(r.clone(), s.clone())));
        assert_eq!(parse_gc_used(&gc_used(&s)), Some(s.clone()));
        assert_eq!(parse_gc_used(&blob(&s)), None);
    }

    /// The keys, spelled out: an existing store is found only if they never move.
    #[test]
    fn keys_are_spelled_as_the_stored_data_expects() {
        let d: OciDigest = "sha256:2d711642b726b04401627ca9fbac32f5c8530fb1903cc4db02258717921a4881".parse().unwrap();
        let s = imgfmt::OciHasher::sha512().finish_with(b"s");
        let (dh, sh) = (d.hex(), s.hex());
        let r = RepoName::parse("a/b").unwrap();
        assert_eq!(blob(&d), format!("blobs/sha256/2d/{dh}"));
        assert_eq!(blob(&s), format!("blobs/sha512/{}/{sh}", &sh[..2]));
        assert_eq!(layer_link(&r, &s), format!("repositories/a/b/_layers/sha512/{sh}"));
        assert_eq!(manifest_link(&r, &d), format!("repositories/a/b/_manifests/sha256/{dh}"));
        assert_eq!(referrer(&r, &d, &s), format!("repositories/a/b/_referrers/sha256/{dh}/sha512-{sh}"));
        assert_eq!(gc_used(&d), format!("_gc/used/sha256/2d/{dh}"));
        assert_eq!(gc_condemned(&s), format!("_gc/condemned/sha512/{sh}"));
        assert_eq!(pulled(&r), "repositories/a/b/_pulled");
        assert_eq!(restore_lease(&r, &d), format!("repositories/a/b/_leases/sha256/{dh}"));
        assert_eq!(gc_retiring_tag(&r, &Tag::parse("v1").unwrap()), "_gc/retiring/a/b/_tags/v1");
        assert_eq!(catalog_entry(&r), "_catalog/a!b");
        assert_eq!(parse_catalog_entry(&catalog_entry(&r)), Some(r.clone()));
        assert_eq!(parse_catalog_entry("_catalog/a/b"), None);
    }
}
