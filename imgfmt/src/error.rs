use crate::digest::OciDigest;

/// Everything that can be wrong with an image's structure or its storage, and what a
/// [`crate::BlobSource`] answers when it cannot serve a read.
///
/// Each variant names the bad value so an operator can find it, and has a [`ErrorKind`]
/// ([`FormatError::kind`]) a caller acts on: retry ([`ErrorKind::Transient`]), ask for a
/// login ([`ErrorKind::Unauthorized`]), fail the check ([`ErrorKind::Integrity`]), and so
/// on. The source errors live here rather than in a type of their own because the format
/// code reads through sources and passes their errors on (`VerifyError::Read`,
/// `UnpackError::Format`, the image opener): one type keeps the kind on the way up
/// without a conversion at each layer, and `BlobSource` keeps its signature. A network
/// source keeps its own error as `source` (`regclient::ClientError` for a registry).
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
    /// repository {repository} does not exist on {registry} (NAME_UNKNOWN)
    RepositoryNotFound { registry: String, repository: String },
    /// blob {digest}: content hashes to {actual}
    BlobDigestMismatch { digest: OciDigest, actual: OciDigest },
    /// bad reference {reference:?}: {reason}
    BadReference { reference: String, reason: String },
    /// {what}: invalid JSON: {source}
    Json { what: &'static str, source: serde_json::Error },
    /// {context}: {source}
    Io { context: String, source: std::io::Error },
    /// {source}
    Unauthorized {
        /// The registry (`HOST[:PORT]`) that wants credentials, or refused the ones it got.
        registry: String,
        source: BoxError,
    },
    /// {source}
    Transient {
        /// What was being read (`range bytes=0-99 of sha256:… from host/repo`).
        what: String,
        source: BoxError,
    },
    /// {source}
    Refused {
        /// What was asked.
        what: String,
        source: BoxError,
    },
}

/// A source's own error, kept whole under a [`FormatError`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// What a caller can do about an error: the classification retries and exit codes are
/// decided by, in the spirit of `object_store::Error`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The blob, manifest, tag or repository does not exist there.
    NotFound,
    /// The registry wants credentials, refused the ones it got (401), or the account may
    /// not read or write there (403): `snapctl login`.
    Unauthorized,
    /// The content is wrong: bytes that do not hash to their digest, a blob shorter or
    /// longer than recorded, structure that does not decode. Fetching once more may tell a
    /// damaged transfer from damaged storage; retrying in a loop does not.
    Integrity,
    /// Failed in a way that may pass (connection reset or refused, timeout, HTTP 5xx, 408,
    /// 429), and the source's own retries are spent: worth retrying later.
    Transient,
    /// Local storage failed (a layout's disk, a file the source reads).
    Io,
    /// The source answered, and the answer to this request is no for another reason (an
    /// HTTP 400 or 405, a registry that ignores `Range`, a bad reference): neither retrying
    /// nor logging in changes it.
    Refused,
}

impl ErrorKind {
    /// Worth trying again after a wait.
    pub fn is_transient(self) -> bool {
        self == ErrorKind::Transient
    }
    /// The content failed its check ("verification said no", exit 1 in the CLI), rather
    /// than "could not check" (every other kind, exit 2).
    pub fn is_integrity(self) -> bool {
        self == ErrorKind::Integrity
    }
}

impl FormatError {
    /// What a caller can do about this error.
    pub fn kind(&self) -> ErrorKind {
        use FormatError::*;
        match self {
            BlobNotFound(_) | TagNotFound { .. } | RepositoryNotFound { .. } => ErrorKind::NotFound,
            Unauthorized { .. } => ErrorKind::Unauthorized,
            Transient { .. } => ErrorKind::Transient,
            Io { .. } => ErrorKind::Io,
            Refused { .. } | BadReference { .. } => ErrorKind::Refused,
            BadMagic { .. }
            | UnsupportedVersion { .. }
            | TooLarge { .. }
            | Invalid { .. }
            | Truncated { .. }
            | OutOfBounds { .. }
            | Overlap { .. }
            | BlobDigestMismatch { .. }
            | Json { .. } => ErrorKind::Integrity,
        }
    }
    /// Worth trying again after a wait ([`ErrorKind::Transient`]).
    pub fn is_transient(&self) -> bool {
        self.kind().is_transient()
    }
    /// The content is wrong ([`ErrorKind::Integrity`]).
    pub fn is_integrity(&self) -> bool {
        self.kind().is_integrity()
    }
    pub(crate) fn invalid(what: &'static str, detail: impl Into<String>) -> Self {
        FormatError::Invalid { what, detail: detail.into() }
    }
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        FormatError::Io { context: context.into(), source }
    }
}
