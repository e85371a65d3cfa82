//! Glue shared by subcommands: opening references, progress bars, exit codes.

use std::io::IsTerminal;
use std::process::ExitCode;

use anyhow::Context;
use imgfmt::reference::{Reference, Selector};
use imgfmt::{BlobSource, FormatError, Image, OciLayout};

/// 0 ok · 1 verification said no · 2 could not answer.
pub const EXIT_OK: u8 = 0;
pub const EXIT_FAILED: u8 = 1;
pub const EXIT_ERROR: u8 = 2;

/// An error whose meaning is "the content failed its check" (exit 1), as opposed to
/// "could not check" (exit 2).
#[derive(Debug)]
pub struct IntegrityError(pub String);
impl std::fmt::Display for IntegrityError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}
impl std::error::Error for IntegrityError {}

/// Whether a format error means the stored image is wrong (rather than unreachable).
pub fn is_integrity(e: &FormatError) -> bool {
    !matches!(e, FormatError::Io { .. } | FormatError::TagNotFound { .. } | FormatError::BadReference { .. })
}

/// `s` made safe to print on a terminal: every control character (C0, DEL, C1) and every
/// bidirectional override is written as its Rust escape (`\u{1b}`, `\n`), so text from
/// an image or a peer (a name, an annotation, a registry's error body) can neither move
/// the cursor, recolour or clear the screen, nor start a line that looks like ours. The
/// decoder already refuses control characters in file names; this covers every other
/// string. Plain text is returned as is.
pub fn printable(s: &str) -> std::borrow::Cow<'_, str> {
    // U+202A..U+202E and U+2066..U+2069 reorder what follows them on screen.
    let unsafe_char = |c: char| c.is_control() || ('\u{202a}'..='\u{202e}').contains(&c) || ('\u{2066}'..='\u{2069}').contains(&c);
    if !s.chars().any(unsafe_char) {
        return std::borrow::Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if unsafe_char(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

/// Exit code for an error that reached `main`.
pub fn exit_code_for(e: &anyhow::Error) -> u8 {
    if e.chain().any(|c| c.downcast_ref::<IntegrityError>().is_some()) {
        return EXIT_FAILED;
    }
    if let Some(v) = e.chain().find_map(|c| c.downcast_ref::<verify::VerifyError>()) {
        return if v.is_read_error() { EXIT_ERROR } else { EXIT_FAILED };
    }
    if let Some(u) = e.chain().find_map(|c| c.downcast_ref::<puller::UnpackError>()) {
        return if u.is_integrity() { EXIT_FAILED } else { EXIT_ERROR };
    }
    EXIT_ERROR
}

pub fn code(c: u8) -> ExitCode {
    ExitCode::from(c)
}

/// A store and the selector within it that a reference names.
pub struct Opened {
    pub source: Box<dyn BlobSource>,
    pub selector: Selector,
    pub reference: String,
}

pub fn open_ref(reference: &str) -> anyhow::Result<Opened> {
    open_ref_plain(reference, false)
}

/// A client for one repository of a registry: plain HTTP when asked (`--plain-http`,
/// `SNAPCTL_PLAIN_HTTP=1`) or for a loopback host; credentials from the docker config.
pub fn registry_client(host: &str, repository: &str, plain_http: bool) -> anyhow::Result<registry::client::RegistrySource> {
    let plain = plain_http || std::env::var_os("SNAPCTL_PLAIN_HTTP").is_some_and(|v| v == "1") || registry::client::is_loopback(host);
    let creds = registry::client::docker_config_credentials(host);
    registry::client::RegistrySource::new(host, repository, plain, creds).with_context(|| format!("connecting to {host}"))
}

/// [`open_ref`], with `--plain-http` for registry references.
pub fn open_ref_plain(reference: &str, plain_http: bool) -> anyhow::Result<Opened> {
    let r: Reference = reference.parse()?;
    match r {
        Reference::Layout { path, selector } => {
            let layout = OciLayout::open(&path).with_context(|| format!("opening {reference}"))?;
            Ok(Opened { source: Box::new(layout), selector, reference: reference.to_string() })
        }
        Reference::Registry { host, repository, selector } => {
            let src = registry_client(&host, &repository, plain_http)?;
            Ok(Opened { source: Box::new(src), selector, reference: reference.to_string() })
        }
    }
}

/// Resolve the manifest digest (exit 2 on failure: there is nothing to check), then open
/// the image (failures there are integrity failures: exit 1).
pub fn open_image(o: &Opened) -> anyhow::Result<Image> {
    let digest = match &o.selector {
        Selector::Tag(t) => o.source.resolve_tag(t).with_context(|| format!("resolving {}", o.reference))?,
        Selector::Digest(d) => d.clone(),
    };
    o.source.blob_size(&digest).with_context(|| format!("{}: manifest {digest}", o.reference))?;
    Image::open(o.source.as_ref(), &digest).map_err(|e| {
        if is_integrity(&e) {
            anyhow::Error::new(IntegrityError(format!("{}: {e}", o.reference)))
        } else {
            anyhow::Error::new(e).context(format!("opening {}", o.reference))
        }
    })
}

/// A byte progress bar on stderr, only when stderr is a terminal.
pub fn progress_bar(total: u64, what: &str) -> Option<indicatif::ProgressBar> {
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let pb = indicatif::ProgressBar::with_draw_target(Some(total), indicatif::ProgressDrawTarget::stderr());
    pb.set_style(
        indicatif::ProgressStyle::with_template("{msg:>8} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    pb.set_message(what.to_string());
    Some(pb)
}

/// Parse a size argument (`1MiB`, `4M`, `65536`).
pub fn parse_size(s: &str) -> Result<u64, String> {
    imgfmt::size::parse_size(s)
}

#[cfg(test)]
mod tests {
    use super::printable;

    /// Issue 14 §16: what is printed from an image or a peer cannot carry a terminal
    /// escape or a line break of its own.
    #[test]
    fn regression_issue_14_printable_escapes_control_and_bidi_characters() {
        assert_eq!(printable("vm.mem"), "vm.mem");
        assert_eq!(printable("mémoire"), "mémoire");
        assert_eq!(printable("a\nFAILED forged"), "a\\nFAILED forged");
        assert_eq!(printable("\x1b[2Jx"), "\\u{1b}[2Jx");
        assert_eq!(printable("x\u{7f}\u{9b}y"), "x\\u{7f}\\u{9b}y");
        assert_eq!(printable("evil\u{202e}gpj.exe"), "evil\\u{202e}gpj.exe");
        assert!(!printable("\r\t\x07\x00").chars().any(|c| c.is_control()));
    }
}
