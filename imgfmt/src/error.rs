use crate::digest::OciDigest;

/// Everything that can be wrong with an image's structure or its storage.
///
/// Each variant names the bad value so an operator can find it.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
#[non_exhaustive]
pub enum FormatError {
    /// {what}: bad magic {found:02x?}, not a snapctl {what}
    BadMagic { what: &'static str, found: Vec<u8> },
    /// {what}: unsupported major version {major} (this build reads {supported})
    UnsupportedVersion { what: &'static str, major: u16, supported: u16 },
    /// {what} is {got}, over the limit of {limit}
    TooLarge { what: &'static str, got: u64, limit: u64 },
    /// {what}: {detail}
    Invalid { what: &'static str, detail: String },
    /// {what} is {got} bytes, expected {expected}
    Truncated { what: &'static str, got: u64, expected: u64 },
    /// file {file}: record {record} points at {offset}+{len}, outside pack {pack} of {pack_size} bytes
    OutOfBounds { file: u32, record: u64, pack: u32, offset: u64, len: u64, pack_size: u64 },
    /// pack {pack}: chunk at {offset}+{len} overlaps another at {other_offset}+{other_len}
    Overlap { pack: u32, offset: u64, len: u64, other_offset: u64, other_len: u64 },
    /// blob {0} not found
    BlobNotFound(OciDigest),
    /// tag {tag:?} not found in {layout}
    TagNotFound { layout: String, tag: String },
    /// blob {digest}: content hashes to {actual}
    BlobDigestMismatch { digest: OciDigest, actual: OciDigest },
    /// bad reference {reference:?}: {reason}
    BadReference { reference: String, reason: String },
    /// {what}: invalid JSON: {source}
    Json { what: &'static str, source: serde_json::Error },
    /// {context}: {source}
    Io { context: String, source: std::io::Error },
}

impl FormatError {
    pub(crate) fn invalid(what: &'static str, detail: impl Into<String>) -> Self {
        FormatError::Invalid { what, detail: detail.into() }
    }
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        FormatError::Io { context: context.into(), source }
    }
}
