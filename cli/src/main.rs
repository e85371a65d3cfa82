//! `snapctl`: the CLI definition plus glue. Each subcommand lives in `cmd/`.
//!
//! Exit codes: 0 ok · 1 verification said no · 2 error (could not answer). A closed stdout
//! (`snapctl inspect REF | head`) ends any command quietly with 0.

// Output goes through `cmd::common::outln!`, which returns the error `println!` panics with.
#![deny(clippy::print_stdout)]

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

mod cmd;

/// Store, move and serve checkpoint images of sandboxes and microVMs.
///
/// Images are OCI artifacts: chunked, hash-verified, content-addressed. References are
/// `oci:PATH[:TAG]` for a local OCI image layout, `HOST[:PORT]/REPO[:TAG|@DIGEST]` for a
/// repository in any OCI registry (read commands).
///
/// Exit codes: 0 ok, 1 verification failed, 2 error.
#[derive(Debug, Parser)]
#[command(name = "snapctl", version = VERSION, max_term_width = 100)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// `snapctl --version`: the release and the commit it was built from (build.rs;
/// `unknown` outside a git checkout).
const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (commit ", env!("SNAPCTL_COMMIT"), ")");

#[derive(Debug, Subcommand)]
enum Command {
    Pack(cmd::pack::PackArgs),
    Unpack(cmd::unpack::UnpackArgs),
    Verify(cmd::verify::VerifyArgs),
    Inspect(cmd::inspect::InspectArgs),
    Diff(cmd::diff::DiffArgs),
    Serve(cmd::serve::ServeArgs),
    Sample(cmd::sample::SampleArgs),
    Gc(cmd::gc::GcArgs),
    Pull(cmd::pull::PullArgs),
    Push(cmd::push::PushArgs),
    Copy(cmd::copy::CopyArgs),
    Tag(cmd::tag::TagArgs),
    Ls(cmd::ls::LsArgs),
    Delete(cmd::delete::DeleteArgs),
    Login(cmd::login::LoginArgs),
    Logout(cmd::login::LogoutArgs),
    Lazy(cmd::lazy::LazyArgs),
    Mount(cmd::mount::MountArgs),
    Umount(cmd::mount::UmountArgs),
    Cache(cmd::cache::CacheArgs),
    Sign(cmd::sign::SignArgs),
    Key(cmd::sign::KeyArgs),
    Completions(cmd::generate::CompletionsArgs),
    Man(cmd::generate::ManArgs),
}

fn main() -> ExitCode {
    let cli = match Cli::from_arg_matches(&command().get_matches()) {
        Ok(c) => c,
        Err(e) => e.exit(),
    };
    match &cli.command {
        Command::Serve(a) => cmd::common::init_logging_as(cmd::serve::DEFAULT_LOG, true, a.log_json()),
        // A daemon's people want its progress (listening, each VM, traces stored) as well,
        // and, as for `serve`, when each thing happened: a daemon runs for months, and a
        // wake's steps are milliseconds apart.
        Command::Lazy(_) => cmd::common::init_logging(cmd::lazy::DEFAULT_LOG, true),
        Command::Mount(_) => cmd::common::init_logging(cmd::mount::DEFAULT_LOG, true),
        _ => cmd::common::init_logging("warn", false),
    }
    if let Some(r) = cli.command.registry_flags() {
        r.install();
    }
    let result = match cli.command {
        Command::Pack(a) => cmd::pack::run(a),
        Command::Unpack(a) => cmd::unpack::run(a),
        Command::Verify(a) => cmd::verify::run(a),
        Command::Inspect(a) => cmd::inspect::run(a),
        Command::Diff(a) => cmd::diff::run(a),
        Command::Sample(a) => cmd::sample::run(a),
        Command::Serve(a) => cmd::serve::run(a),
        Command::Gc(a) => cmd::gc::run(a),
        Command::Pull(a) => cmd::pull::run(a),
        Command::Push(a) => cmd::push::run(a),
        Command::Copy(a) => cmd::copy::run(a),
        Command::Tag(a) => cmd::tag::run(a),
        Command::Ls(a) => cmd::ls::run(a),
        Command::Delete(a) => cmd::delete::run(a),
        Command::Login(a) => cmd::login::run_login(a),
        Command::Logout(a) => cmd::login::run_logout(a),
        Command::Lazy(a) => cmd::lazy::run(a),
        Command::Mount(a) => cmd::mount::run(a),
        Command::Umount(a) => cmd::mount::run_umount(a),
        Command::Cache(a) => cmd::cache::run(a),
        Command::Sign(a) => cmd::sign::run_sign(a),
        Command::Key(a) => cmd::sign::run_key(a),
        Command::Completions(a) => cmd::generate::completions(a, command()),
        Command::Man(a) => cmd::generate::man(a, command()),
    };
    match result {
        Ok(code) => code,
        Err(e) if cmd::common::is_stdout_closed(&e) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("snapctl: {}", describe(&e));
            if let Some(h) = cmd::common::hint_for(&e) {
                eprintln!("hint: {}", cmd::common::printable(&h));
            }
            ExitCode::from(cmd::common::exit_code_for(&e))
        }
    }
}

/// The CLI as parsed and documented: `-h` shows each flag's first sentence (and its
/// default), `--help` and the man pages all of it.
fn command() -> clap::Command {
    short_help(Cli::command())
}

/// `cmd` and its commands with each flag's help cut to its first sentence, the whole
/// kept as the long help (a flag whose doc has paragraphs has both already).
fn short_help(cmd: clap::Command) -> clap::Command {
    cmd.mut_args(|a| {
        let Some(full) = a.get_help().filter(|_| a.get_long_help().is_none()).map(ToString::to_string) else { return a };
        let short = first_sentence(&full);
        if short.len() < full.len() {
            a.help(short).long_help(full)
        } else {
            a
        }
    })
    .mut_subcommands(short_help)
}

/// Longest first sentence kept whole in `-h` (about two lines of the help's column).
const SHORT_HELP_MAX: usize = 120;

/// The first sentence of `help` (a period outside parentheses, before a space or the
/// end, not one of "e.g." or "i.e."), with the `[default: …]` the text ends with.
fn first_sentence(help: &str) -> String {
    let mut depth = 0i32;
    let mut end = help.len();
    let bytes = help.as_bytes();
    for (i, c) in help.char_indices() {
        match c {
            '(' | '[' => depth += 1,
            ')' | ']' => depth -= 1,
            '.' if depth <= 0 && bytes.get(i + 1).is_none_or(u8::is_ascii_whitespace) => {
                let before = &help[..i];
                if !(before.ends_with("e.g") || before.ends_with("i.e") || before.ends_with("etc")) {
                    end = i + 1;
                    break;
                }
            }
            _ => {}
        }
    }
    let mut short = help[..end].trim_end().to_string();
    if short.len() > SHORT_HELP_MAX {
        // A long first sentence: up to its last clause that fits (a break outside brackets).
        let mut depth = 0i32;
        let mut cut = None;
        for (i, c) in short.char_indices().take_while(|(i, _)| *i < SHORT_HELP_MAX) {
            match c {
                '(' | '[' => depth += 1,
                ')' | ']' => depth -= 1,
                ',' | ';' | ':' if depth <= 0 && short.as_bytes().get(i + 1) == Some(&b' ') => cut = Some(i),
                _ => {}
            }
        }
        if let Some(i) = cut {
            short.truncate(i);
            short.push_str(" …");
        }
    }
    if let Some(default) = help.rfind("[default:").map(|i| help[i..].trim_end()).filter(|d| d.ends_with(']') && !short.contains(*d)) {
        short.push(' ');
        // A default that explains itself at length: its first clause.
        match default.find([',', ';']).filter(|_| default.len() > 60) {
            Some(i) => {
                short.push_str(&default[..i]);
                short.push_str(", …]");
            }
            None => short.push_str(default),
        }
    }
    short
}

impl Command {
    /// How this command reaches registries, if it reaches any.
    fn registry_flags(&self) -> Option<&cmd::common::RegistryFlags> {
        match self {
            Command::Pack(a) => Some(&a.registry),
            Command::Unpack(a) => Some(&a.registry),
            Command::Verify(a) => Some(&a.registry),
            Command::Inspect(a) => Some(&a.registry),
            Command::Diff(a) => Some(&a.registry),
            Command::Pull(a) => Some(&a.registry),
            Command::Push(a) => Some(&a.transfer.registry),
            Command::Copy(a) => Some(&a.transfer.registry),
            Command::Tag(a) => Some(&a.registry),
            Command::Ls(a) => Some(&a.registry),
            Command::Delete(a) => Some(&a.registry),
            Command::Login(a) => Some(&a.registry),
            Command::Lazy(a) => Some(&a.registry),
            Command::Mount(a) => Some(&a.registry),
            Command::Sign(a) => Some(&a.registry),
            Command::Serve(_)
            | Command::Key(_)
            | Command::Cache(_)
            | Command::Umount(_)
            | Command::Sample(_)
            | Command::Gc(_)
            | Command::Logout(_)
            | Command::Completions(_)
            | Command::Man(_) => None,
        }
    }
}

/// The error and its causes joined by ": ", each cause only if the text so far does not
/// already hold it: the library errors put their source in their own message, so
/// `{:#}` printed "X: File too large: X: File too large: File too large". Control
/// characters are escaped: an error may quote a name, a header or a body from a peer.
/// Line breaks stay (a TOML error draws the line it could not read under its message),
/// each further line indented, so no line can pass for one of ours ("snapctl: …",
/// "hint: …") whoever wrote it.
fn describe(e: &anyhow::Error) -> String {
    join_causes(e).trim_end().split('\n').map(cmd::common::printable).collect::<Vec<_>>().join("\n  ")
}

fn join_causes(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let s = cause.to_string();
        if out.is_empty() || s.starts_with(out.as_str()) {
            // A cause that repeats what the context said, and more ("resolving X" over
            // "resolving X: gave up …"), is the whole line.
            out = s;
        } else if !out.contains(&s) {
            out.push_str(": ");
            out.push_str(&s);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use clap::FromArgMatches as _;

    use super::{cmd, command, describe, first_sentence, Cli, Command};

    #[test]
    fn short_help_is_the_first_sentence_and_the_default() {
        assert_eq!(first_sentence("Speak plain HTTP (e.g. to 127.0.0.1). More about it."), "Speak plain HTTP (e.g. to 127.0.0.1).");
        assert_eq!(first_sentence("Jobs, e.g. 4. More [default: 8]"), "Jobs, e.g. 4. [default: 8]");
        assert_eq!(first_sentence("Close after this. Longer text [default: 120s]"), "Close after this. [default: 120s]");
        assert_eq!(first_sentence("One sentence only"), "One sentence only");
        assert_eq!(first_sentence("Files (a.b, c.d). Then"), "Files (a.b, c.d).");
        let long = format!("Clause one (with, commas), {} and more [default: 1]", "word ".repeat(30));
        assert_eq!(first_sentence(&long), "Clause one (with, commas) … [default: 1]");
    }

    #[test]
    fn causes_already_in_the_message_are_not_repeated() {
        let io = std::io::Error::other("File too large");
        let lib = imgfmt::FormatError::Io { context: "writing a pack into /x".into(), source: io };
        let e = anyhow::Error::new(lib).context("packing /src");
        assert_eq!(describe(&e), "packing /src: writing a pack into /x: File too large");
        let plain = anyhow::anyhow!("inner").context("outer");
        assert_eq!(describe(&plain), "outer: inner");
        // Issue 25: "resolving X: resolving X: gave up …", the context said again by the
        // library's message.
        let lib = imgfmt::FormatError::Transient { what: "resolving h/r:v1".into(), source: "resolving h/r:v1: gave up after 6 attempts".into() };
        assert_eq!(describe(&anyhow::Error::new(lib).context("resolving h/r:v1")), "resolving h/r:v1: gave up after 6 attempts");
        let hostile = anyhow::anyhow!("registry said: \x1b[2J\nsnapctl: all good");
        assert_eq!(describe(&hostile), "registry said: \\u{1b}[2J\n  snapctl: all good");
        let crlf = anyhow::anyhow!("a\r\nb");
        assert_eq!(describe(&crlf), "a\\r\n  b");
    }

    /// `args` parsed as the binary does, or clap's error.
    fn parse(args: &[&str]) -> Result<Command, clap::Error> {
        let m = command().try_get_matches_from(std::iter::once("snapctl").chain(args.iter().copied()))?;
        Ok(Cli::from_arg_matches(&m)?.command)
    }

    /// Each command's host cache flags, as parsed and resolved: (directory, budget, no_cache).
    fn host_cache(c: &Command) -> (std::path::PathBuf, u64, bool) {
        match c {
            Command::Pull(a) => (a.cache.dir.path(), a.cache.budget.cache_size, a.cache.no_cache),
            Command::Lazy(a) => (a.cache.dir.path(), a.cache.budget.cache_size, a.cache.no_cache),
            Command::Mount(a) => (a.cache.dir.path(), a.cache.budget.cache_size, a.cache.no_cache),
            Command::Push(a) => (a.transfer.cache_dir(), a.budget.cache_size, false),
            Command::Cache(a) => (a.common.dir.path(), a.common.budget.cache_size, false),
            other => panic!("no host cache flags: {other:?}"),
        }
    }

    /// The commands that take the host cache flags, each with the arguments it requires.
    const CACHE_COMMANDS: [&[&str]; 5] =
        [&["pull", "h/r:v1", "out"], &["lazy", "h/r:v1", "--socket", "s"], &["mount", "h/r:v1", "dir"], &["push", "dir", "h/r:v1"], &["cache", "prune"]];

    #[test]
    fn every_command_parses_the_cache_flags_alike() {
        // The defaults are the libraries' own (the budget unless the environment sets
        // another).
        let default = std::env::var("SNAPCTL_CACHE_SIZE").map_or(puller::cache::DEFAULT_LIMIT, |v| imgfmt::size::parse_size(&v).unwrap());
        for args in CACHE_COMMANDS {
            let (dir, size, no_cache) = host_cache(&parse(args).unwrap());
            assert_eq!((dir, size, no_cache), (puller::ChunkCache::default_dir(), default, false), "{args:?}");
            let given = [args, &["--cache", "/c", "--cache-size", "3GiB"][..]].concat();
            let (dir, size, _) = host_cache(&parse(&given).unwrap());
            assert_eq!((dir, size), ("/c".into(), 3 << 30), "{given:?}");
            let bad = [args, &["--cache-size", "3XB"][..]].concat();
            let e = parse(&bad).unwrap_err();
            assert_eq!(e.kind(), clap::error::ErrorKind::ValueValidation, "{bad:?}");
        }
    }

    #[test]
    fn no_cache_refuses_a_cache_directory_and_takes_a_size() {
        for args in &CACHE_COMMANDS[..3] {
            let (_, _, no_cache) = host_cache(&parse(&[args, &["--no-cache"][..]].concat()).unwrap());
            assert!(no_cache, "{args:?}");
            // A budget is harmless without a cache: $SNAPCTL_CACHE_SIZE set for every
            // command must not make `--no-cache` an error.
            assert!(parse(&[args, &["--no-cache", "--cache-size", "1GiB"][..]].concat()).is_ok(), "{args:?}");
            let e = parse(&[args, &["--no-cache", "--cache", "/c"][..]].concat()).unwrap_err();
            assert_eq!(e.kind(), clap::error::ErrorKind::ArgumentConflict, "{args:?}");
        }
    }

    #[test]
    fn the_cache_flags_read_the_same_in_every_command_and_show_the_library_default() {
        assert_eq!(cmd::cache::default_size(), "10GiB");
        assert_eq!(imgfmt::size::parse_size(cmd::cache::default_size()), Ok(puller::cache::DEFAULT_LIMIT));
        let cli = command();
        for id in ["cache_size", "no_cache"] {
            let helps: Vec<_> = ["pull", "lazy", "mount", "push", "cache"]
                .iter()
                .filter_map(|name| cli.find_subcommand(name).unwrap().get_arguments().find(|a| a.get_id() == id))
                .map(|a| (a.get_long_help().or(a.get_help()).map(ToString::to_string), a.get_default_values().to_vec(), a.get_env().map(ToOwned::to_owned)))
                .collect();
            assert!(helps.len() >= 3, "{id}");
            assert!(helps.windows(2).all(|w| w[0] == w[1]), "{id}: {helps:?}");
        }
        let size = cli.find_subcommand("pull").unwrap().get_arguments().find(|a| a.get_id() == "cache_size").unwrap();
        assert_eq!(size.get_default_values(), [cmd::cache::default_size()]);
        assert_eq!(size.get_env(), Some(std::ffi::OsStr::new("SNAPCTL_CACHE_SIZE")));
    }
}
