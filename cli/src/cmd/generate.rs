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
            clap_mangen::generate_to(cli, &dir).with_context(|| format!("writing man pages into {}", dir.display()))?;
            eprintln!("wrote man pages into {}", dir.display());
            Ok(common::code(common::EXIT_OK))
        }
        None => {
            let mut out = Vec::new();
            clap_mangen::Man::new(cli).render(&mut out).context("rendering the man page")?;
            write_stdout(&out)
        }
    }
}

/// `bytes` on stdout (a closed stdout ends the command quietly, as everywhere).
fn write_stdout(bytes: &[u8]) -> anyhow::Result<ExitCode> {
    use std::io::Write;
    let mut o = std::io::stdout().lock();
    o.write_all(bytes).and_then(|()| o.flush()).map_err(common::StdoutError)?;
    Ok(common::code(common::EXIT_OK))
}
