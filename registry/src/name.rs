//! Repository names and tags, validated against the OCI Distribution grammar before they
//! ever become part of a storage key (so `..`, absolute paths and the like cannot).

use std::fmt;

/// Longest repository name accepted (the spec suggests clients keep name + host under 255).
pub const MAX_NAME_LEN: usize = 255;
/// Longest tag the grammar allows: `[a-zA-Z0-9_][a-zA-Z0-9._-]{0,127}`.
pub const MAX_TAG_LEN: usize = 128;

/// A repository name matching
/// `[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*(\/[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*)*`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RepoName(String);

/// A tag matching `[a-zA-Z0-9_][a-zA-Z0-9._-]{0,127}`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tag(String);

/// Why a name or tag was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, displaydoc::Display)]
#[non_exhaustive]
pub enum NameError {
    /// invalid repository name {0:?}
    BadName(String),
    /// invalid tag {0:?}
    BadTag(String),
}

impl RepoName {
    /// Validate a repository name.
    pub fn parse(s: &str) -> Result<RepoName, NameError> {
        // One grammar for names, shared with the references clients parse.
        if s.len() > MAX_NAME_LEN || imgfmt::reference::check_repository(s).is_err() {
            return Err(NameError::BadName(s.to_owned()));
        }
        Ok(RepoName(s.to_owned()))
    }

    /// The name as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Tag {
    /// Validate a tag.
    pub fn parse(s: &str) -> Result<Tag, NameError> {
        let ok = s.len() <= MAX_TAG_LEN && imgfmt::layout::check_tag(s).is_ok();
        if !ok {
            return Err(NameError::BadTag(s.to_owned()));
        }
        Ok(Tag(s.to_owned()))
    }

    /// The tag as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for RepoName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Display for Tag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_spec_names() {
        for ok in ["a", "library/ubuntu", "a.b_c__d---e/f0", "snap/vm-1", "x/y/z"] {
            RepoName::parse(ok).unwrap();
        }
    }

    #[test]
    fn refuses_traversal_and_bad_names() {
        for bad in ["", "..", "../etc", "a/../b", "/abs", "a/", "a//b", "A", "a..b", "a___b", "-a", "a-", "a/.b", "a/_uploads", "a\\b", "a%2f..", "a b", "_tmp"]
        {
            assert!(RepoName::parse(bad).is_err(), "{bad:?} accepted");
        }
        assert!(RepoName::parse(&"a".repeat(256)).is_err());
    }

    #[test]
    fn tags() {
        for ok in ["latest", "v1.0", "_x", "A-b_c.d"] {
            Tag::parse(ok).unwrap();
        }
        for bad in ["", ".x", "-x", "a/b", "..", &"a".repeat(129)] {
            assert!(Tag::parse(bad).is_err(), "{bad:?} accepted");
        }
    }
}
