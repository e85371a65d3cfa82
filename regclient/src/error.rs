//! What can go wrong talking to a registry, and the registry's own words for it (the OCI
//! error body `{"errors":[{"code":…,"message":…}]}`).

use imgfmt::{ErrorKind, FormatError, OciDigest};

use crate::Unreachable;

/// An error of the registry client. The doc comment of each variant is its message.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
#[non_exhaustive]
pub enum ClientError {
    /// {what}: registry answered HTTP {status}: {message}
    Registry { what: String, status: u16, code: Option<String>, message: String },
    /// {what}: {message}
    Http { what: String, message: String },
    /// {what}: gave up after {attempts} attempts: {last}
    RetriesExhausted { what: String, attempts: u32, last: String },
    /// {host} wants credentials: run `snapctl login {host}` (or add it to ~/.docker/config.json)
    NeedsCredentials { host: String },
    /// wrong user or password for {host}
    WrongCredentials { host: String },
    /// reading blob {digest} from the source: {source}
    Source { digest: OciDigest, source: FormatError },
    /// blob {digest}: the source's bytes hash to {actual}; nothing was committed
    DigestMismatch { digest: OciDigest, actual: OciDigest },
    /// {what}: {limit}-byte limit exceeded
    TooLarge { what: String, limit: u64 },
    /// {path}: {source}
    State { path: std::path::PathBuf, source: std::io::Error },
    /// credentials for {host}: {source}
    Credentials { host: String, source: CredentialsError },
    /// cannot reach {host}: {detail}
    Unreachable {
        host: String,
        why: Unreachable,
        detail: String,
        /// What to change ([`Unreachable::hint`]); see [`ClientError::hint`].
        hint: String,
    },
}

/// Docker's credential configuration (`config.json` and its credential helpers) could not
/// answer. "No credentials" is not an error: lookups say `None`.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
#[non_exhaustive]
pub enum CredentialsError {
    /// {path}: {source}
    Config { path: std::path::PathBuf, source: std::io::Error },
    /// {value:?} ({origin} in {config}) is not a credential helper name
    BadHelperName { value: String, origin: String, config: std::path::PathBuf },
    /// cannot run {program} ({origin} in {config}): {source}
    HelperNotRun { program: String, origin: String, config: std::path::PathBuf, source: std::io::Error },
    /// {program} {action} failed ({status}): {message}
    HelperFailed { program: String, action: &'static str, status: String, message: String },
    /// {program} {action} did not answer within {secs} s ({origin} in {config}): killed it; SNAPCTL_CREDENTIAL_HELPER_TIMEOUT sets how long to wait
    HelperTimedOut { program: String, action: &'static str, secs: f64, origin: String, config: std::path::PathBuf },
    /// {program} get: not the credentials JSON ({reason})
    HelperAnswer { program: String, reason: String },
}

impl ClientError {
    /// The HTTP status a registry answered with, when this is a registry's refusal.
    pub fn status(&self) -> Option<u16> {
        match self {
            ClientError::Registry { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// What a caller can do about this error (see [`ErrorKind`]): 401 and 403 want a
    /// login, 404 is not found, retries spent on 5xx, 429 or a broken connection are
    /// transient; any other answer of the registry is a refusal.
    pub fn kind(&self) -> ErrorKind {
        match self {
            ClientError::Registry { status: 401 | 403, .. } | ClientError::NeedsCredentials { .. } | ClientError::WrongCredentials { .. } => {
                ErrorKind::Unauthorized
            }
            ClientError::Registry { status: 404, .. } => ErrorKind::NotFound,
            ClientError::Registry { .. }
            | ClientError::Http { .. }
            | ClientError::Credentials { .. }
            | ClientError::TooLarge { .. }
            | ClientError::Unreachable { .. } => ErrorKind::Refused,
            ClientError::RetriesExhausted { .. } => ErrorKind::Transient,
            ClientError::Source { source, .. } => source.kind(),
            ClientError::DigestMismatch { .. } => ErrorKind::Integrity,
            ClientError::State { .. } => ErrorKind::Io,
        }
    }

    /// The line that says how to fix this error, when there is one (a flag to pass).
    pub fn hint(&self) -> Option<&str> {
        match self {
            ClientError::Unreachable { hint, .. } => Some(hint),
            _ => None,
        }
    }

    /// This error as a source's error, its kind kept: a registry's refusal stays a
    /// [`FormatError`] variant of the same [`ErrorKind`] with this error as its source.
    /// `registry` is the host the client talks to (named by an unauthorized error).
    pub fn into_source_error(self, registry: &str) -> FormatError {
        let what = match &self {
            ClientError::Registry { what, .. }
            | ClientError::Http { what, .. }
            | ClientError::RetriesExhausted { what, .. }
            | ClientError::TooLarge { what, .. } => what.clone(),
            _ => registry.to_string(),
        };
        match (self.kind(), self) {
            (_, ClientError::Source { source, .. }) => source,
            (_, ClientError::DigestMismatch { digest, actual }) => FormatError::BlobDigestMismatch { digest, actual },
            (_, ClientError::State { path, source }) => FormatError::Io { context: path.display().to_string(), source },
            (ErrorKind::Unauthorized, e) => FormatError::Unauthorized { registry: registry.to_string(), source: Box::new(e) },
            (ErrorKind::Transient, e) => FormatError::Transient { what, source: Box::new(e) },
            (_, e) => FormatError::Refused { what, source: Box::new(e) },
        }
    }
}

impl From<ClientError> for FormatError {
    fn from(e: ClientError) -> FormatError {
        let registry = match &e {
            ClientError::NeedsCredentials { host }
            | ClientError::WrongCredentials { host }
            | ClientError::Credentials { host, .. }
            | ClientError::Unreachable { host, .. } => host.clone(),
            _ => "the registry".to_string(),
        };
        e.into_source_error(&registry)
    }
}

/// The registry's explanation from an OCI error body: `CODE: message[; CODE: message…]`,
/// with the first code on its own. Bodies that are not OCI error JSON are quoted (cut to
/// 300 characters) so a proxy's HTML error page still says something. Control characters
/// become spaces (runs of them one space): the text is the registry's, printed on a
/// terminal.
pub fn explain(status: u16, body: &[u8]) -> (Option<String>, String) {
    explain_for(status, body, "HOST")
}

/// [`explain`], with the hint to log in naming `host` (the registry's `HOST[:PORT]`).
pub(crate) fn explain_for(status: u16, body: &[u8], host: &str) -> (Option<String>, String) {
    #[derive(serde::Deserialize)]
    struct Body {
        #[serde(default)]
        errors: Vec<Item>,
    }
    #[derive(serde::Deserialize)]
    struct Item {
        #[serde(default)]
        code: String,
        #[serde(default)]
        message: String,
    }
    if let Ok(b) = serde_json::from_slice::<Body>(body) {
        if !b.errors.is_empty() {
            let text = b
                .errors
                .iter()
                .map(|e| if e.message.is_empty() { e.code.clone() } else { format!("{}: {}", e.code, e.message) })
                .collect::<Vec<_>>()
                .join("; ");
            let first = Some(b.errors[0].code.clone()).filter(|c| !c.is_empty()).map(|c| sanitize(&c));
            return (first, with_hint(status, sanitize(&text), host));
        }
    }
    let text = sanitize(&String::from_utf8_lossy(body));
    let text: String = text.chars().take(300).collect();
    let text = if text.is_empty() { reason(status).to_string() } else { text };
    (None, with_hint(status, text, host))
}

/// `s` on one line: every run of control characters one space, trimmed.
fn sanitize(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut gap = false;
    for c in s.chars() {
        if c.is_control() || c.is_whitespace() {
            gap = true;
        } else {
            if gap && !out.is_empty() {
                out.push(' ');
            }
            gap = false;
            out.push(c);
        }
    }
    out
}

fn with_hint(status: u16, text: String, host: &str) -> String {
    match status {
        401 => format!("{text} (hint: run `snapctl login {host}`)"),
        403 => format!("{text} (hint: the account lacks access to this repository; `snapctl login {host}` as one that has it)"),
        _ => text,
    }
}

fn reason(status: u16) -> &'static str {
    reqwest::StatusCode::from_u16(status).ok().and_then(|s| s.canonical_reason()).unwrap_or("no explanation")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oci_error_json() {
        let (code, msg) = explain(400, br#"{"errors":[{"code":"DIGEST_INVALID","message":"content is x, not y","detail":null}]}"#);
        assert_eq!(code.as_deref(), Some("DIGEST_INVALID"));
        assert_eq!(msg, "DIGEST_INVALID: content is x, not y");
        let (_, msg) = explain(413, br#"{"errors":[{"code":"SIZE_INVALID","message":"a"},{"code":"B","message":""}]}"#);
        assert_eq!(msg, "SIZE_INVALID: a; B");
    }

    #[test]
    fn other_bodies() {
        let (code, msg) = explain(404, b"404 page not found\n");
        assert_eq!((code, msg.as_str()), (None, "404 page not found"));
        let (_, msg) = explain(502, b"");
        assert_eq!(msg, "Bad Gateway");
        let (_, msg) = explain(401, br#"{"errors":[{"code":"UNAUTHORIZED","message":"authentication required"}]}"#);
        assert!(msg.contains("snapctl login"), "{msg}");
        let long = "x".repeat(1000);
        assert_eq!(explain(500, long.as_bytes()).1.len(), 300);
        // The registry's words on one line, without a terminal escape of theirs.
        let (_, msg) = explain(500, b"disk full:\n\x1b[2J No space\r\n left  on device\n");
        assert_eq!(msg, "disk full: [2J No space left on device");
        let (_, msg) = explain(500, br#"{"errors":[{"code":"UNKNOWN","message":"write /x: no space\n\u001b[31mleft"}]}"#);
        assert_eq!(msg, "UNKNOWN: write /x: no space [31mleft");
    }
}
