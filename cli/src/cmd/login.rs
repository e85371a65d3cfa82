//! `snapctl login` / `snapctl logout`: credentials for a registry in Docker's config.json.

use std::io::{BufRead, IsTerminal};
use std::process::ExitCode;

use anyhow::{bail, Context};
use regclient::{docker_config_path, Credentials, RegistrySource, Stored};

use super::common;

/// Log in to a registry: check the credentials, then store them.
///
/// The credentials are checked against the registry (GET /v2/, answering its Basic or
/// token challenge) before anything is written. They are stored as docker stores them:
/// through the credential helper Docker's config names for the host (credHelpers, else
/// credsStore: docker-credential-NAME store), or else in the config itself
/// ($DOCKER_CONFIG/config.json, else ~/.docker/config.json; shared with docker, skopeo,
/// oras; base64, not encrypted), replaced atomically with mode 0600, keeping every other
/// entry.
///
/// Without --password-stdin, the password is asked for on the terminal (not echoed).
///
/// Examples:
///   snapctl login registry.example.com -u alice
///   echo "$TOKEN" | snapctl login registry.example.com -u ci --password-stdin
///   snapctl login 127.0.0.1:5000 -u alice --password-stdin < ./password
#[derive(Debug, clap::Args)]
#[command(verbatim_doc_comment)]
pub struct LoginArgs {
    /// Registry: HOST[:PORT].
    pub host: String,
    /// User name.
    #[arg(short, long)]
    pub username: String,
    /// Read the password from stdin (its first line).
    #[arg(long)]
    pub password_stdin: bool,
    /// The password on the command line (visible to other users in `ps`: prefer
    /// --password-stdin).
    #[arg(short, long, conflicts_with = "password_stdin")]
    pub password: Option<String>,
    #[command(flatten)]
    pub registry: super::common::RegistryFlags,
}

/// Log out of a registry: remove its credentials from Docker's config and from the
/// credential helper it names for the host.
///
/// Example:
///   snapctl logout registry.example.com
#[derive(Debug, clap::Args)]
#[command(verbatim_doc_comment)]
pub struct LogoutArgs {
    /// Registry: HOST[:PORT].
    pub host: String,
}

fn check_host(host: &str) -> anyhow::Result<()> {
    if host.is_empty() || host.contains('/') || host.contains(char::is_whitespace) || host.contains("://") {
        bail!("{host:?}: expected a registry host, HOST[:PORT] (no scheme, no path)");
    }
    Ok(())
}

pub fn run_login(a: LoginArgs) -> anyhow::Result<ExitCode> {
    check_host(&a.host)?;
    let password = match (&a.password, a.password_stdin) {
        (Some(p), _) => {
            eprintln!("warning: a password on the command line is visible to other users; use --password-stdin");
            p.clone()
        }
        (None, true) => {
            let mut line = String::new();
            std::io::stdin().lock().take_line(&mut line).context("reading the password from stdin")?;
            line.trim_end_matches(['\r', '\n']).to_string()
        }
        (None, false) => {
            if !std::io::stdin().is_terminal() {
                bail!("no password: stdin is not a terminal to ask on; pipe it with --password-stdin");
            }
            rpassword::prompt_password(format!("Password for {} at {}: ", a.username, a.host)).context("reading the password from the terminal")?
        }
    };
    if password.is_empty() {
        bail!("empty password");
    }
    let creds = Credentials::Password { username: a.username.clone(), password };
    let client = RegistrySource::connect(&a.host, "", &a.registry.transport(), Some(creds.clone())).with_context(|| format!("connecting to {}", a.host))?;
    client.check_login().with_context(|| format!("login to {} as {} failed", a.host, a.username))?;
    let path = docker_config_path().context("no home directory: set DOCKER_CONFIG")?;
    let stored = regclient::store_docker_credentials(&path, &a.host, &creds).with_context(|| format!("storing the credentials for {}", a.host))?;
    match stored {
        Stored::Helper(name) => eprintln!("logged in to {} as {} (credentials stored by docker-credential-{name})", a.host, a.username),
        _ => {
            eprintln!("logged in to {} as {} (credentials in {})", a.host, a.username, path.display());
            eprintln!("warning: the password is stored unencrypted in {}; a credential helper (credsStore) keeps it in a keychain", path.display());
        }
    }
    Ok(common::code(common::EXIT_OK))
}

pub fn run_logout(a: LogoutArgs) -> anyhow::Result<ExitCode> {
    check_host(&a.host)?;
    let path = docker_config_path().context("no home directory: set DOCKER_CONFIG")?;
    if regclient::remove_docker_credentials(&path, &a.host).with_context(|| format!("removing the credentials for {}", a.host))? {
        eprintln!("removed credentials for {}", a.host);
    } else {
        eprintln!("not logged in to {}", a.host);
    }
    Ok(common::code(common::EXIT_OK))
}

/// One line, bounded: a password is not megabytes long.
trait TakeLine {
    fn take_line(&mut self, out: &mut String) -> std::io::Result<usize>;
}

impl<R: BufRead> TakeLine for R {
    fn take_line(&mut self, out: &mut String) -> std::io::Result<usize> {
        use std::io::Read;
        self.take(64 << 10).read_line(out)
    }
}
