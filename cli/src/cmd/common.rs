//! Glue shared by subcommands: opening references, progress bars, exit codes, stdout,
//! logging, and the grammars of size and duration flags.

use std::io::{IsTerminal, Write as _};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use imgfmt::reference::{Reference, Selector};
use imgfmt::{BlobSource, ErrorKind, FormatError, Image, ImageStore};

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

/// Whether an error opening an image means the stored image is wrong (rather than
/// unreachable): its content failed a check, or a blob its manifest names is missing (the
/// image is incomplete; a missing manifest or tag is found out before, exit 2).
pub fn is_integrity(e: &FormatError) -> bool {
    e.is_integrity() || matches!(e, FormatError::BlobNotFound(_))
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

/// The policy refused an image (exit 1).
#[derive(Debug)]
pub struct PolicyRefused(pub String);
impl std::fmt::Display for PolicyRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}
impl std::error::Error for PolicyRefused {}

/// Exit code for an error that reached `main`, from the kind of the error's outermost
/// verdict ([`error_kind`]): 1 when the content failed its check, 2 for anything else.
pub fn exit_code_for(e: &anyhow::Error) -> u8 {
    match error_kind(e) {
        Some(k) if k.is_integrity() => EXIT_FAILED,
        _ => EXIT_ERROR,
    }
}

/// The [`ErrorKind`] of the outermost error in `e`'s chain that renders a verdict on
/// content: a check of this binary ([`IntegrityError`]), a chunk's verification, an unpack
/// or a pull. A library error that reaches `main` outside of those (a push's, a gc's) is
/// an error (exit 2), whatever its kind: it is not a verification's answer.
pub fn error_kind(e: &anyhow::Error) -> Option<ErrorKind> {
    e.chain().find_map(|c| {
        if c.is::<IntegrityError>() || c.is::<PolicyRefused>() {
            Some(ErrorKind::Integrity)
        } else if let Some(v) = c.downcast_ref::<verify::VerifyError>() {
            Some(v.kind())
        } else {
            c.downcast_ref::<puller::UnpackError>().map(puller::UnpackError::kind)
        }
    })
}

/// Writing to stdout failed. When the reader has gone (`snapctl inspect REF | head -n 3`:
/// EPIPE), `main` ends the command quietly with status 0: the data was not wanted any more.
/// Any other failure (a full disk behind a redirection) is an error like any other.
#[derive(Debug)]
pub struct StdoutError(pub std::io::Error);
impl std::fmt::Display for StdoutError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "writing to stdout: {}", self.0)
    }
}
impl std::error::Error for StdoutError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.0)
    }
}

/// Whether `e` says that stdout's reader has gone (and nothing else went wrong).
pub fn is_stdout_closed(e: &anyhow::Error) -> bool {
    e.chain().any(|c| c.downcast_ref::<StdoutError>().is_some_and(|s| s.0.kind() == std::io::ErrorKind::BrokenPipe))
}

/// Write one line to stdout, returning the error `println!` would panic with. Every byte a
/// command prints goes through here (the crate denies `clippy::print_stdout`).
pub fn write_stdout(args: std::fmt::Arguments<'_>) -> Result<(), StdoutError> {
    let mut out = std::io::stdout().lock();
    out.write_fmt(args).and_then(|()| out.write_all(b"\n")).map_err(StdoutError)
}

/// `println!` that returns a [`StdoutError`] instead of panicking.
macro_rules! outln {
    () => { $crate::cmd::common::write_stdout(format_args!("")) };
    ($($arg:tt)*) => { $crate::cmd::common::write_stdout(format_args!($($arg)*)) };
}
pub(crate) use outln;

/// Print `value` as pretty JSON on stdout, one document.
pub fn print_json<T: serde::Serialize + ?Sized>(value: &T) -> anyhow::Result<()> {
    let text = serde_json::to_string_pretty(value).context("serializing the report")?;
    write_stdout(format_args!("{text}"))?;
    Ok(())
}

/// Print `value` as JSON on one line of stdout (streams of reports, `--json` of gc).
pub fn print_json_line<T: serde::Serialize + ?Sized>(value: &T) -> anyhow::Result<()> {
    let text = serde_json::to_string(value).context("serializing the report")?;
    write_stdout(format_args!("{text}"))?;
    Ok(())
}

/// Install the log subscriber every command uses: `tracing` events of the libraries (and
/// of the CLI) on stderr, filtered by `SNAPCTL_LOG`, else `RUST_LOG`, else `default`
/// (filter directives: `warn`, `warn,registry=info`, `debug`, …). Clients print level and
/// message; a server (`timestamps`) adds the time and the module, for its log files. A
/// filter that does not parse is reported on stderr and `default` used instead.
pub fn init_logging(default: &str, timestamps: bool) {
    init_logging_as(default, timestamps, false)
}

/// [`init_logging`], with each line written as one JSON object when `json` (a server's
/// `--log-format json`: the event's fields at the top level, beside `timestamp`, `level`,
/// `target` and `message`).
pub fn init_logging_as(default: &str, timestamps: bool, json: bool) {
    use tracing_subscriber::EnvFilter;
    let mut rejected = None;
    let filter = ["SNAPCTL_LOG", "RUST_LOG"]
        .iter()
        .find_map(|var| {
            let v = std::env::var(var).ok().filter(|v| !v.trim().is_empty())?;
            Some(EnvFilter::try_new(&v).map_err(|e| rejected = Some(format!("{var}={v:?} ({e})"))).ok())
        })
        .flatten()
        .unwrap_or_else(|| EnvFilter::new(default));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(false);
    let _ = if json {
        builder.json().flatten_event(true).try_init()
    } else if timestamps {
        builder.try_init()
    } else {
        builder.without_time().with_target(false).try_init()
    };
    if let Some(r) = rejected {
        tracing::warn!("ignoring {r}: logging at {default:?}");
    }
}

pub fn code(c: u8) -> ExitCode {
    ExitCode::from(c)
}

/// A store and the selector within it that a reference names.
pub struct Opened {
    pub source: std::sync::Arc<dyn ImageStore>,
    /// The same client as `source` when the reference names a registry.
    pub registry: Option<std::sync::Arc<regclient::RegistrySource>>,
    pub selector: Selector,
    pub reference: String,
}

/// Open the store `reference` names: the one opener of every command (registries are
/// reached as the command's [`RegistryFlags`] say).
pub fn open_ref(reference: &str) -> anyhow::Result<Opened> {
    open_parsed(&reference.parse()?, reference)
}

/// [`open_ref`] of `r`, parsed already from `reference`. Its reads are not a restore (no
/// pull is recorded); a command restoring the image opens it with [`open_to_restore`].
pub fn open_parsed(r: &Reference, reference: &str) -> anyhow::Result<Opened> {
    open_for(r, reference, regclient::Purpose::Read)
}

/// [`open_parsed`] for a command that restores the image (pull, unpack, lazy, mount,
/// copy's source): the registry records its manifest reads as pulls.
pub fn open_to_restore(r: &Reference, reference: &str) -> anyhow::Result<Opened> {
    open_for(r, reference, regclient::Purpose::Restore)
}

fn open_for(r: &Reference, reference: &str, purpose: regclient::Purpose) -> anyhow::Result<Opened> {
    let o = regclient::open(r, &regclient::Transport { purpose, ..transport() }).with_context(|| match r.host() {
        Some(host) => format!("connecting to {host}"),
        None => format!("opening {reference}"),
    })?;
    Ok(Opened { source: o.store, registry: o.registry, selector: o.selector, reference: reference.to_string() })
}

/// How to reach registries, for every command that reads or writes one (flattened into
/// its arguments; `main` installs them before the command runs).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct RegistryFlags {
    /// Speak plain HTTP to the registry (the default for 127.0.0.1, ::1 and localhost
    /// unless a TLS flag is given; also SNAPCTL_PLAIN_HTTP=1).
    #[arg(long, conflicts_with_all = ["ca_file", "insecure", "tls_verify"])]
    pub plain_http: bool,
    /// Trust the CA certificates in this PEM file for the registry's TLS (repeatable),
    /// besides Mozilla's roots and the system's (SSL_CERT_FILE and SSL_CERT_DIR when set).
    /// A loopback registry is then spoken to in HTTPS.
    #[arg(long, value_name = "FILE")]
    pub ca_file: Vec<std::path::PathBuf>,
    /// Do not verify the registry's TLS certificate (a test registry with a self-signed
    /// one; anyone on the path can read and change what is sent). HTTPS also to a
    /// loopback registry.
    #[arg(long, conflicts_with = "tls_verify")]
    pub insecure: bool,
    /// skopeo's spelling: `true` speaks HTTPS with a verified certificate to every
    /// registry, loopback included; `false` is --insecure.
    #[arg(long, value_name = "BOOL", action = clap::ArgAction::Set)]
    pub tls_verify: Option<bool>,
}

impl RegistryFlags {
    /// The transport these flags (and `SNAPCTL_PLAIN_HTTP=1`) ask for.
    pub fn transport(&self) -> regclient::Transport {
        regclient::Transport {
            plain_http: self.plain_http || std::env::var_os("SNAPCTL_PLAIN_HTTP").is_some_and(|v| v == "1"),
            tls_on_loopback: self.tls_verify.is_some(),
            ca_files: self.ca_file.clone(),
            insecure: self.insecure || self.tls_verify == Some(false),
            purpose: regclient::Purpose::Read,
        }
    }

    /// Make these the flags every registry client of this process is built with (the
    /// CLI runs one command per process; `main` calls this once, before the command).
    pub fn install(&self) {
        let _ = TRANSPORT.set(self.transport());
    }
}

/// The registry flags of the running command ([`RegistryFlags::install`]).
static TRANSPORT: std::sync::OnceLock<regclient::Transport> = std::sync::OnceLock::new();

/// The installed transport, else the one of no flags.
fn transport() -> regclient::Transport {
    TRANSPORT.get().cloned().unwrap_or_else(|| RegistryFlags::default().transport())
}

/// A client for one repository of a registry, reached as the command's flags say
/// ([`RegistryFlags`]); credentials from the docker config and the credential helpers it
/// names, when the registry asks.
pub fn registry_client(host: &str, repository: &str) -> anyhow::Result<regclient::RegistrySource> {
    regclient::RegistrySource::connect_with_docker_credentials(host, repository, &transport()).with_context(|| format!("connecting to {host}"))
}

/// [`registry_client`] of a command that restores the image (`lazy`): its manifest reads
/// are pulls.
pub fn registry_client_to_restore(host: &str, repository: &str) -> anyhow::Result<regclient::RegistrySource> {
    let t = regclient::Transport { purpose: regclient::Purpose::Restore, ..transport() };
    regclient::RegistrySource::connect_with_docker_credentials(host, repository, &t).with_context(|| format!("connecting to {host}"))
}

/// The `hint:` line for an error, when a part of it says how to fix it (a registry that
/// cannot be reached names the flag that reaches it).
pub fn hint_for(e: &anyhow::Error) -> Option<String> {
    e.chain().find_map(|c| c.downcast_ref::<regclient::ClientError>().and_then(|c| c.hint()).map(str::to_string))
}

/// Resolve the manifest digest (exit 2 on failure: there is nothing to check), then open
/// the image (failures there are integrity failures: exit 1).
pub fn open_image(o: &Opened) -> anyhow::Result<Image> {
    let digest = resolve(o)?;
    open_image_at(o, &digest)
}

/// The manifest digest the reference names (its tag resolved). A tag a registry does not
/// have is told apart from a repository it does not have (registries answer both
/// `MANIFEST_UNKNOWN`; the tag list says `NAME_UNKNOWN`).
pub fn resolve(o: &Opened) -> anyhow::Result<imgfmt::OciDigest> {
    resolve_in(o.source.as_ref(), &o.selector, &o.reference).map_err(|e| {
        let tag_missing = e.chain().any(|c| matches!(c.downcast_ref::<FormatError>(), Some(FormatError::TagNotFound { .. })));
        if !tag_missing || o.registry.is_none() {
            return e;
        }
        match o.source.tags() {
            Err(missing @ FormatError::RepositoryNotFound { .. }) => anyhow::Error::new(missing).context(format!("resolving {}", o.reference)),
            _ => e,
        }
    })
}

/// The manifest digest `selector` names in `source` (named `reference` in messages): the
/// one place a tag becomes a digest.
pub fn resolve_in(source: &dyn BlobSource, selector: &Selector, reference: &str) -> anyhow::Result<imgfmt::OciDigest> {
    Ok(match selector {
        Selector::Tag(t) => source.resolve_tag(t).with_context(|| format!("resolving {reference}"))?,
        Selector::Digest(d) => d.clone(),
    })
}

/// [`open_image`] of the manifest `digest` (resolved already).
pub fn open_image_at(o: &Opened, digest: &imgfmt::OciDigest) -> anyhow::Result<Image> {
    open_image_in(o.source.as_ref(), &Selector::Digest(digest.clone()), &o.reference)
}

/// [`open_image`] of `selector` in `source` (named `reference` in messages).
pub fn open_image_in(source: &dyn BlobSource, selector: &Selector, reference: &str) -> anyhow::Result<Image> {
    let digest = resolve_in(source, selector, reference)?;
    Image::open(source, &digest).map_err(|e| opening_failed(e, reference, &digest))
}

/// [`open_image`] through `src` (`o`'s source, shared), the outboards still being read
/// when it returns, as `ahead` says ([`Image::open_outboards_later`]).
pub fn open_image_outboards_later(
    src: std::sync::Arc<dyn BlobSource>,
    o: &Opened,
    ahead: imgfmt::OutboardsAhead,
) -> anyhow::Result<(Image, imgfmt::PendingOutboards)> {
    let digest = resolve(o)?;
    Image::open_outboards_later(src, &digest, ahead).map_err(|e| opening_failed(e, &o.reference, &digest))
}

/// Why an image could not be opened, as the CLI reports it. A missing manifest is an
/// error (exit 2: there is nothing to check); anything else wrong with what it names,
/// down to a blob it lists that is missing, is an integrity failure (exit 1).
fn opening_failed(e: imgfmt::FormatError, reference: &str, manifest: &imgfmt::OciDigest) -> anyhow::Error {
    match e {
        imgfmt::FormatError::BlobNotFound(d) if &d == manifest => {
            anyhow::Error::new(imgfmt::FormatError::BlobNotFound(d)).context(format!("{reference}: manifest {manifest}"))
        }
        e if is_integrity(&e) => anyhow::Error::new(IntegrityError(format!("{reference}: {e}"))),
        e => anyhow::Error::new(e).context(format!("opening {reference}")),
    }
}

/// Every progress bar of the process, drawn together on stderr (packing and the uploads
/// that go on beside it show as two lines, not one overwriting the other).
fn bars() -> &'static indicatif::MultiProgress {
    static BARS: std::sync::OnceLock<indicatif::MultiProgress> = std::sync::OnceLock::new();
    BARS.get_or_init(|| indicatif::MultiProgress::with_draw_target(indicatif::ProgressDrawTarget::stderr()))
}

/// Print `line` on stderr, above the progress bars when there are some (they are drawn
/// again below it).
pub fn say(line: &str) {
    bars().suspend(|| eprintln!("{line}"));
}

/// A byte progress bar on stderr, only when stderr is a terminal. Its ETA is from the
/// rate over the last few seconds ([`RecentRate`]), not from the average since the start.
pub fn progress_bar(total: u64, what: &str) -> Option<indicatif::ProgressBar> {
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let pb = bars().add(indicatif::ProgressBar::new(total));
    pb.set_style(
        indicatif::ProgressStyle::with_template("{msg:>8} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {recent_eta}")
            .expect("valid template")
            .with_key("recent_eta", RecentRate::eta())
            .progress_chars("=> "),
    );
    pb.set_message(what.to_string());
    Some(pb)
}

/// A byte progress bar on stderr (only when stderr is a terminal) for a transfer with a
/// registry: the bar counts the work done (cache hits and blobs the registry has included,
/// so it ends at the total), and the rate beside it is the network's, from the body bytes
/// the registry client moved ([`regclient::bytes_transferred`]) over the last few seconds.
pub fn network_progress_bar(total: u64, what: &str) -> Option<indicatif::ProgressBar> {
    bar_with_eta(total, what, RecentRate::eta())
}

/// [`network_progress_bar`] for a download (`pull`), redrawn four times a second: the time
/// left is taken at the faster of the bar's rate and the network's. The bar moves when a range's chunks are verified
/// (megabytes at a time), the network's count as bytes arrive, so it is the truer one
/// while the link sets the pace; the bar's is while the chunks come from the cache.
pub fn download_progress_bar(total: u64, what: &str) -> Option<indicatif::ProgressBar> {
    let pb = bar_with_eta(total, what, RecentRate::eta_fastest())?;
    // Redrawn four times a second: the rate and the estimate move while a range arrives.
    pb.enable_steady_tick(Duration::from_millis(250));
    Some(pb)
}

fn bar_with_eta(total: u64, what: &str, eta: RecentRate) -> Option<indicatif::ProgressBar> {
    let pb = progress_bar(total, what)?;
    // Someone watches: range bodies are counted as they arrive, so the rate moves with them.
    regclient::count_as_bytes_arrive(true);
    pb.set_style(
        indicatif::ProgressStyle::with_template("{msg:>8} [{bar:30}] {bytes}/{total_bytes} {net} eta {recent_eta}")
            .expect("valid template")
            .with_key("net", RecentRate::network())
            .with_key("recent_eta", eta)
            .progress_chars("=> "),
    );
    Some(pb)
}

/// A bar on stderr (only when stderr is a terminal) for uploads whose total grows as it
/// becomes known (`push DIR`: the packs sealed so far, then the whole image): bytes sent
/// of the total, the network's rate, and the time left at the recent rate. Redrawn four
/// times a second, so the rate and the estimate move between pieces.
pub fn upload_bar(what: &str) -> Option<indicatif::ProgressBar> {
    let pb = network_progress_bar(0, what)?;
    pb.enable_steady_tick(Duration::from_millis(250));
    Some(pb)
}

/// A rate over the last few seconds, for a progress bar: of the bar's own position,
/// shown as the time left at that rate, or of the body bytes the registry client moved,
/// shown as the network's rate. Indicatif's own estimate weighs the whole history, so a
/// bar that leapt at its start (zeros, blobs already there) promised the end too soon.
#[derive(Clone)]
struct RecentRate {
    window: std::sync::Arc<std::sync::Mutex<std::collections::VecDeque<(std::time::Instant, u64)>>>,
    shows: Shows,
    /// For an estimate: the network's rate, taken instead of the bar's when faster.
    net: Option<Box<RecentRate>>,
}

/// What a [`RecentRate`] measures and shows.
#[derive(Clone, Copy)]
enum Shows {
    /// The bar's position: what is left at its rate.
    Eta,
    /// [`regclient::bytes_transferred`]: bytes per second.
    Network,
}

/// The rate is taken over this much of the recent past.
const RATE_WINDOW: Duration = Duration::from_secs(3);
/// No rate from a window shorter than this.
const MIN_RATE_SPAN: Duration = Duration::from_millis(500);

impl RecentRate {
    fn eta() -> RecentRate {
        RecentRate { window: Default::default(), shows: Shows::Eta, net: None }
    }

    fn network() -> RecentRate {
        RecentRate { window: Default::default(), shows: Shows::Network, net: None }
    }

    fn eta_fastest() -> RecentRate {
        RecentRate { window: Default::default(), shows: Shows::Eta, net: Some(Box::new(RecentRate::network())) }
    }

    /// Units per second between the oldest sample in the window and `(now, value)`, which
    /// joins the window; `None` until the window spans [`MIN_RATE_SPAN`].
    fn rate(&self, now: std::time::Instant, value: u64) -> Option<f64> {
        let mut w = self.window.lock().unwrap_or_else(|p| p.into_inner());
        while w.len() > 1 && w.front().is_some_and(|(t, _)| now.duration_since(*t) > RATE_WINDOW) {
            w.pop_front();
        }
        w.push_back((now, value));
        let (t0, v0) = w[0];
        let span = now.duration_since(t0);
        (span >= MIN_RATE_SPAN).then(|| value.saturating_sub(v0) as f64 / span.as_secs_f64())
    }

    /// The time `left` takes at the recent rate of a position now at `pos`: `None` until
    /// there is a rate, or while nothing moves.
    fn eta_at(&self, now: std::time::Instant, pos: u64, left: u64) -> Option<Duration> {
        self.eta_with(now, pos, left, self.net.is_some().then(regclient::bytes_transferred))
    }

    /// [`eta_at`](Self::eta_at), the network's count given (`None`: the bar's rate alone).
    fn eta_with(&self, now: std::time::Instant, pos: u64, left: u64, net_bytes: Option<u64>) -> Option<Duration> {
        let net = self.net.as_ref().zip(net_bytes).and_then(|(n, b)| n.rate(now, b));
        let rate = match (self.rate(now, pos), net) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        if left == 0 {
            return Some(Duration::ZERO);
        }
        rate.filter(|r| *r > 0.0).map(|r| Duration::from_secs_f64((left as f64 / r).min(1e7)))
    }
}

impl indicatif::style::ProgressTracker for RecentRate {
    fn clone_box(&self) -> Box<dyn indicatif::style::ProgressTracker> {
        Box::new(self.clone())
    }
    fn tick(&mut self, _: &indicatif::ProgressState, _: std::time::Instant) {}
    fn reset(&mut self, _: &indicatif::ProgressState, _: std::time::Instant) {
        self.window.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }
    fn write(&self, state: &indicatif::ProgressState, w: &mut dyn std::fmt::Write) {
        let now = std::time::Instant::now();
        let _ = match self.shows {
            Shows::Eta => match self.eta_at(now, state.pos(), state.len().unwrap_or(0).saturating_sub(state.pos())) {
                Some(d) => write!(w, "{}", indicatif::HumanDuration(d)),
                None => write!(w, "?"),
            },
            Shows::Network => {
                let rate = self.rate(now, regclient::bytes_transferred()).unwrap_or(0.0);
                write!(w, "{}/s net", imgfmt::size::human(rate as u64))
            }
        };
    }
}

/// Parse a size argument (`1MiB`, `4M`, `65536`).
pub fn parse_size(s: &str) -> Result<u64, String> {
    imgfmt::size::parse_size(s)
}

/// Parse a duration argument, for every duration flag of the CLI (`imgfmt::size::parse_duration`).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    imgfmt::size::parse_duration(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The network rate is bytes moved over the window, not work done: a pull whose
    /// chunks come from the cache or are zero shows 0 B/s.
    #[test]
    fn the_network_rate_counts_moved_bytes_over_a_window() {
        let r = RecentRate::network();
        let t = std::time::Instant::now();
        assert_eq!(r.rate(t, 1000), None, "no rate from one sample");
        assert_eq!(r.rate(t + Duration::from_secs(1), 1000), Some(0.0), "nothing moved");
        assert_eq!(r.rate(t + Duration::from_secs(2), 1000 + (4 << 20)), Some((2 << 20) as f64), "4 MiB over 2 s");
        // Samples older than the window leave it.
        assert_eq!(r.rate(t + Duration::from_secs(6), 1000 + (4 << 20)), Some(0.0));
    }

    /// Issue 39: a pull's bar leapt to half (zeros) and promised the end in a second for
    /// five. The estimate is what is left at the rate of the last seconds.
    #[test]
    fn regression_issue_39_the_eta_is_from_the_recent_rate() {
        let r = RecentRate::eta();
        let t = std::time::Instant::now();
        assert_eq!(r.eta_at(t, 128 << 20, 128 << 20), None, "no rate from one sample, whatever came before");
        assert_eq!(r.eta_at(t + Duration::from_secs(1), (128 << 20) + (25 << 20), 103 << 20), Some(Duration::from_secs_f64(103.0 / 25.0)));
        // A stall empties the rate once the window has only the stall.
        assert_eq!(r.eta_at(t + Duration::from_secs(6), 153 << 20, 103 << 20), None);
        assert_eq!(r.eta_at(t + Duration::from_secs(7), 153 << 20, 0), Some(Duration::ZERO));
    }

    /// Issue 39: at 200 Mbit/s a pull's bar, moved only by whole 8 MiB ranges, stood still
    /// and then said "eta 1 second" with 2.4 s left. Its estimate takes the network's
    /// rate when that is the faster, and the bar's when the chunks come from the cache.
    #[test]
    fn regression_issue_39_a_downloads_eta_takes_the_faster_of_the_bars_and_the_networks_rate() {
        let r = RecentRate::eta_fastest();
        let t = std::time::Instant::now();
        let at = |s: f64| t + Duration::from_secs_f64(s);
        assert_eq!(r.eta_with(t, 0, 100 << 20, Some(0)), None);
        // The bar has not moved; 20 MiB arrived in a second: 100 MiB left at 20 MiB/s.
        assert_eq!(r.eta_with(at(1.0), 0, 100 << 20, Some(20 << 20)), Some(Duration::from_secs(5)));
        // From the cache: the bar moves 50 MiB in a second, the network not at all.
        let r = RecentRate::eta_fastest();
        assert_eq!(r.eta_with(t, 0, 100 << 20, Some(7)), None);
        assert_eq!(r.eta_with(at(1.0), 50 << 20, 50 << 20, Some(7)), Some(Duration::from_secs(1)));
    }

    #[test]
    fn one_duration_grammar() {
        for (s, ms) in [
            ("500ms", 500),
            ("90s", 90_000),
            ("2m", 120_000),
            ("1h", 3_600_000),
            ("1h30m", 5_400_000),
            ("1h 30m", 5_400_000),
            ("7d", 604_800_000),
            ("1.5s", 1500),
            ("120", 120_000),
            ("0", 0),
            ("0s", 0),
        ] {
            assert_eq!(parse_duration(s), Ok(Duration::from_millis(ms)), "{s}");
        }
        for bad in ["", "soon", "-1s", "1x", "h", "99999999999999999999", "99999999999999999999d"] {
            assert!(parse_duration(bad).is_err(), "{bad:?}");
        }
    }

    /// One classification: a read that failed for want of a login, or for a registry still
    /// down, is "could not answer" (2); content that failed its check is 1.
    #[test]
    fn exit_codes_come_from_the_error_kind() {
        let read = |source| anyhow::Error::new(verify::VerifyError::Read { file: "vm.mem".into(), chunk: 3, offset: 0, source }).context("pulling");
        let unauthorized = FormatError::Unauthorized { registry: "r".into(), source: "HTTP 401".into() };
        assert_eq!(exit_code_for(&read(unauthorized)), EXIT_ERROR);
        assert_eq!(exit_code_for(&read(FormatError::Transient { what: "range".into(), source: "HTTP 503".into() })), EXIT_ERROR);
        assert_eq!(exit_code_for(&read(FormatError::BlobNotFound(imgfmt::OciDigest::of(b"p")))), EXIT_ERROR);
        let d = imgfmt::ChunkDigest::default();
        let mismatch = verify::VerifyError::DigestMismatch { file: "vm.mem".into(), chunk: 3, offset: 0, expected: d, actual: d };
        assert_eq!(exit_code_for(&anyhow::Error::new(puller::UnpackError::Verify(mismatch)).context("pulling")), EXIT_FAILED);
        assert_eq!(exit_code_for(&anyhow::Error::new(IntegrityError("manifest".into()))), EXIT_FAILED);
        assert_eq!(exit_code_for(&anyhow::Error::new(puller::UnpackError::Exists("/x".into()))), EXIT_ERROR);
        // A library error outside a verdict is an error whatever its kind.
        assert_eq!(
            exit_code_for(&anyhow::Error::new(FormatError::BlobDigestMismatch { digest: imgfmt::OciDigest::of(b"a"), actual: imgfmt::OciDigest::of(b"b") })),
            EXIT_ERROR
        );
    }

    #[test]
    fn only_a_closed_stdout_is_quiet() {
        let closed = anyhow::Error::new(StdoutError(std::io::ErrorKind::BrokenPipe.into())).context("printing");
        assert!(is_stdout_closed(&closed));
        let full = anyhow::Error::new(StdoutError(std::io::Error::from_raw_os_error(28)));
        assert!(!is_stdout_closed(&full), "a full disk is an error");
        // A broken pipe elsewhere (a registry connection) is not stdout's.
        let socket = anyhow::Error::new(std::io::Error::from(std::io::ErrorKind::BrokenPipe));
        assert!(!is_stdout_closed(&socket));
    }

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
