//! `snapctl completions SHELL` and `snapctl man`: what shells and `man` read, generated
//! from the CLI definition itself (so they cannot drift from `--help`).

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;

use super::common;

/// Print a shell completion script.
///
/// Examples:
///   snapctl completions bash > /etc/bash_completion.d/snapctl
///   snapctl completions zsh > "${fpath[1]}/_snapctl"
///   snapctl completions fish > ~/.config/fish/completions/snapctl.fish
#[derive(Debug, clap::Args)]
#[command(verbatim_doc_comment)]
pub struct CompletionsArgs {
    /// The shell.
    pub shell: clap_complete::Shell,
}

/// Print the man page, or write one per command into a directory.
///
/// Examples:
///   snapctl man | man -l -
///   snapctl man --dir /usr/local/share/man/man1   # snapctl.1, snapctl-push.1, ...
#[derive(Debug, clap::Args)]
#[command(verbatim_doc_comment)]
pub struct ManArgs {
    /// Write snapctl.1 and snapctl-COMMAND.1 for every command here instead.
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
}

pub fn completions(a: CompletionsArgs, mut cli: clap::Command) -> anyhow::Result<ExitCode> {
    let mut out = Vec::new();
    clap_complete::generate(a.shell, &mut cli, "snapctl", &mut out);
    write_stdout(&out)
}

pub fn man(a: ManArgs, cli: clap::Command) -> anyhow::Result<ExitCode> {
    match a.dir {
        Some(dir) => {
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            let mut cli = cli.disable_help_subcommand(true);
            cli.build();
            write_pages(cli, &dir).with_context(|| format!("writing man pages into {}", dir.display()))?;
            eprintln!("wrote man pages into {}", dir.display());
            Ok(common::code(common::EXIT_OK))
        }
        None => {
            let mut out = Vec::new();
            render(cli, &mut out).context("rendering the man page")?;
            write_stdout(&out)
        }
    }
}

/// The page of `cmd` and of each of its commands, as `clap_mangen::generate_to` names them.
fn write_pages(cmd: clap::Command, dir: &std::path::Path) -> std::io::Result<()> {
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()).cloned() {
        write_pages(sub, dir)?;
    }
    let path = dir.join(clap_mangen::Man::new(cmd.clone()).get_filename());
    let mut out = Vec::new();
    render(cmd, &mut out)?;
    std::fs::write(path, out)
}

/// A man page: clap_mangen's, then ENVIRONMENT and FILES (the same on every page: each
/// command reads them).
fn render(cmd: clap::Command, w: &mut dyn std::io::Write) -> std::io::Result<()> {
    use clap_mangen::roff::{bold, roman, Roff};
    clap_mangen::Man::new(cmd).render(w)?;
    let mut roff = Roff::default();
    // A default the CLI takes from a library is filled in, as clap does in --help.
    let fill = |entries: &[(&'static str, &str)]| -> Vec<(&'static str, String)> {
        entries.iter().map(|(name, what)| (*name, what.replace("{cache_size}", super::cache::default_size()))).collect()
    };
    for (title, entries) in [("ENVIRONMENT", fill(ENVIRONMENT)), ("FILES", fill(FILES))] {
        roff.control("SH", [title]);
        for (name, what) in entries {
            roff.control("TP", []);
            roff.text([bold(name)]);
            roff.text([roman(what)]);
        }
    }
    roff.to_writer(w)
}

/// What the environment changes, for the man pages' ENVIRONMENT section (`{cache_size}`:
/// `--cache-size`'s default).
const ENVIRONMENT: &[(&str, &str)] = &[
    (
        "SNAPCTL_LOG, RUST_LOG",
        "Log filter on stderr (warn, info, debug, or directives such as warn,registry=info). Default: warn; for serve, lazy and mount: info.",
    ),
    (
        "SNAPCTL_CACHE",
        "The cache directory (as --cache): chunk cache, push layouts, upload state, known blobs. Default: $XDG_CACHE_HOME/snapctl, else ~/.cache/snapctl.",
    ),
    ("SNAPCTL_CACHE_SIZE", "Bound on the cache directory (as --cache-size). Default: {cache_size}."),
    ("SNAPCTL_PLAIN_HTTP", "1: speak plain HTTP to every registry (as --plain-http)."),
    ("SNAPCTL_REQUEST_TIMEOUT", "The floor of the deadline of one registry request, answer included (a duration, e.g. 30s)."),
    ("SNAPCTL_RETRY_BUDGET", "How long transient registry failures are retried, from the first try. Default: 120s."),
    ("SNAPCTL_CREDENTIAL_HELPER_TIMEOUT", "How long a Docker credential helper may take before it is killed."),
    ("SNAPCTL_POLICY", "The signature policy file (as --policy)."),
    ("SNAPCTL_MOUNT_HOST", "The host mount point of mount (as --host)."),
    ("DOCKER_CONFIG", "The directory of Docker's config.json, where login stores credentials. Default: ~/.docker."),
    ("COSIGN_PASSWORD", "The password of a cosign key file (sign, key generate); else a prompt on the terminal."),
    ("SSL_CERT_FILE, SSL_CERT_DIR", "CA certificates trusted for registries, besides Mozilla's roots."),
    ("AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_ALLOW_HTTP", "The S3 store of serve --storage s3://BUCKET/PREFIX."),
];

/// Files read and written, for the man pages' FILES section.
const FILES: &[(&str, &str)] = &[
    ("~/.docker/config.json", "Registry credentials, and the credential helpers it names (login, logout; read by every command that reaches a registry)."),
    ("~/.cache/snapctl/", "The chunk cache, push layouts, resumable upload state and which repositories hold which blobs (see snapctl cache)."),
    ("~/.config/containers/policy.json, /etc/containers/policy.json", "The signature policy, when neither --policy nor SNAPCTL_POLICY names one."),
    ("/run/snapctl/mount", "The host mount of mount, as root (else under $XDG_RUNTIME_DIR)."),
];

/// `bytes` on stdout (a closed stdout ends the command quietly, as everywhere).
fn write_stdout(bytes: &[u8]) -> anyhow::Result<ExitCode> {
    use std::io::Write;
    let mut o = std::io::stdout().lock();
    o.write_all(bytes).and_then(|()| o.flush()).map_err(common::StdoutError)?;
    Ok(common::code(common::EXIT_OK))
}
