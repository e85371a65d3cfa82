//! Docker credential helpers: the `docker-credential-NAME` programs that keep registry
//! secrets in a keychain (Docker Desktop's `desktop`, `osxkeychain`, `secretservice`,
//! `pass`, `ecr-login`, …), spoken to as docker does (docker/docker-credential-helpers):
//!
//! ```text
//! get    stdin: SERVER                                   stdout: {"ServerURL","Username","Secret"}
//! store  stdin: {"ServerURL","Username","Secret"}        stdout: nothing
//! erase  stdin: SERVER                                   stdout: nothing
//! ```
//!
//! A failure is a non-zero exit with the message on stdout; "credentials not found in
//! native keychain" means there are none (not an error). A `Username` of `<token>` means
//! `Secret` is an identity token (an OAuth2 refresh token for the registry's token flow).

use std::io::Write as _;
use std::process::{Command, Stdio};

use super::{Credentials, CredentialsError};

/// The user name helpers store beside an identity token.
const TOKEN_USERNAME: &str = "<token>";

/// A helper named by a docker config, and where it was named (for messages).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Helper {
    /// NAME of `docker-credential-NAME`.
    pub name: String,
    /// `credsStore` or `credHelpers["HOST"]`.
    pub origin: String,
    /// The config file that named it.
    pub config: std::path::PathBuf,
}

/// What helpers read and write (the field names are the protocol's).
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "PascalCase")]
struct HelperCredentials {
    #[serde(rename = "ServerURL", default)]
    server_url: String,
    #[serde(default)]
    username: String,
    #[serde(default)]
    secret: String,
}

/// How a helper call ended.
enum Outcome {
    /// Exit 0, with this on stdout.
    Done(Vec<u8>),
    /// Non-zero exit, and what the helper said (stdout, where helpers write it, then stderr).
    Failed { status: String, message: String },
}

impl Outcome {
    /// Whether a failure means "no credentials for this server": docker's helpers say
    /// "credentials not found in native keychain"; others shorten it.
    fn not_found(&self) -> bool {
        matches!(self, Outcome::Failed { message, .. } if message.to_ascii_lowercase().contains("credentials not found"))
    }
}

impl Helper {
    fn program(&self) -> String {
        format!("docker-credential-{}", self.name)
    }

    /// Run `action` with `input` on stdin.
    fn call(&self, action: &'static str, input: &[u8]) -> Result<Outcome, CredentialsError> {
        // A name is looked up on PATH, as docker does; a path would run an arbitrary file.
        if self.name.is_empty() || self.name.contains(['/', '\0']) {
            return Err(CredentialsError::BadHelperName { value: self.name.clone(), origin: self.origin.clone(), config: self.config.clone() });
        }
        let program = self.program();
        let not_run = |source| CredentialsError::HelperNotRun { program: program.clone(), origin: self.origin.clone(), config: self.config.clone(), source };
        let mut child = Command::new(&program).arg(action).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().map_err(not_run)?;
        if let Some(mut stdin) = child.stdin.take() {
            // A helper that exits without reading its input fails this write (EPIPE);
            // its exit status and message say more than the write error would.
            let _ = stdin.write_all(input);
        }
        // The helper is a program the user configured, trusted like snapctl itself; its
        // answers are a few hundred bytes.
        let out = child.wait_with_output().map_err(not_run)?;
        if out.status.success() {
            return Ok(Outcome::Done(out.stdout));
        }
        let mut message = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
        if message.is_empty() {
            message = stderr;
        } else if !stderr.is_empty() {
            message = format!("{message} ({stderr})");
        }
        if message.is_empty() {
            message = "no message".into();
        }
        Ok(Outcome::Failed { status: out.status.to_string(), message })
    }

    /// The error for a failed `action` (any outcome but `Done`).
    fn failed(&self, action: &'static str, outcome: Outcome) -> CredentialsError {
        let (status, message) = match outcome {
            Outcome::Failed { status, message } => (status, message),
            Outcome::Done(_) => (String::new(), String::new()),
        };
        CredentialsError::HelperFailed { program: self.program(), action, status, message }
    }

    /// The helper's credentials for `server`; `None` when it has none.
    pub fn get(&self, server: &str) -> Result<Option<Credentials>, CredentialsError> {
        match self.call("get", server.as_bytes())? {
            Outcome::Done(out) => parse_get(&self.program(), &out),
            o if o.not_found() => Ok(None),
            o => Err(self.failed("get", o)),
        }
    }

    /// Store `creds` for `server` in the helper's keychain.
    pub fn store(&self, server: &str, creds: &Credentials) -> Result<(), CredentialsError> {
        let (username, secret) = match creds {
            Credentials::Password { username, password } => (username.clone(), password.clone()),
            Credentials::IdentityToken(t) => (TOKEN_USERNAME.to_string(), t.clone()),
        };
        let body = serde_json::to_vec(&HelperCredentials { server_url: server.into(), username, secret }).expect("serializes");
        match self.call("store", &body)? {
            Outcome::Done(_) => Ok(()),
            o => Err(self.failed("store", o)),
        }
    }

    /// Remove `server`'s credentials; `Ok(false)` when the helper had none.
    pub fn erase(&self, server: &str) -> Result<bool, CredentialsError> {
        match self.call("erase", server.as_bytes())? {
            Outcome::Done(_) => Ok(true),
            o if o.not_found() => Ok(false),
            o => Err(self.failed("erase", o)),
        }
    }
}

/// A `get` answer: a username and password, an identity token, or (an empty secret) none.
fn parse_get(program: &str, out: &[u8]) -> Result<Option<Credentials>, CredentialsError> {
    let c: HelperCredentials = serde_json::from_slice(out).map_err(|e| CredentialsError::HelperAnswer { program: program.into(), reason: e.to_string() })?;
    if c.secret.is_empty() {
        return Ok(None);
    }
    Ok(Some(if c.username == TOKEN_USERNAME {
        Credentials::IdentityToken(c.secret)
    } else {
        Credentials::Password { username: c.username, password: c.secret }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn get_answers() {
        let p = "docker-credential-x";
        match parse_get(p, br#"{"ServerURL":"r.io","Username":"alice","Secret":"pw"}"#).unwrap() {
            Some(Credentials::Password { username, password }) => assert_eq!((username.as_str(), password.as_str()), ("alice", "pw")),
            other => panic!("{other:?}"),
        }
        match parse_get(p, br#"{"ServerURL":"r.io","Username":"<token>","Secret":"refresh"}"#).unwrap() {
            Some(Credentials::IdentityToken(t)) => assert_eq!(t, "refresh"),
            other => panic!("{other:?}"),
        }
        assert!(parse_get(p, br#"{"ServerURL":"r.io","Username":"","Secret":""}"#).unwrap().is_none());
        let e = parse_get(p, b"credentials not found").unwrap_err().to_string();
        assert!(e.starts_with("docker-credential-x get: not the credentials JSON"), "{e}");
    }

    #[test]
    fn not_found_is_recognised() {
        let failed = |m: &str| Outcome::Failed { status: "exit status: 1".into(), message: m.into() };
        assert!(failed("credentials not found in native keychain").not_found());
        assert!(failed("Credentials not found").not_found());
        assert!(!failed("the keychain is locked").not_found());
        assert!(!Outcome::Done(Vec::new()).not_found());
    }

    #[test]
    fn a_missing_helper_and_a_path_are_clear_errors() {
        let h = |name: &str| Helper { name: name.into(), origin: "credsStore".into(), config: "/home/u/.docker/config.json".into() };
        let e = h("snapctl-surely-not-installed").get("r.io").unwrap_err().to_string();
        assert!(e.starts_with("cannot run docker-credential-snapctl-surely-not-installed (credsStore in /home/u/.docker/config.json)"), "{e}");
        let e = h("../../bin/sh").get("r.io").unwrap_err().to_string();
        assert!(e.contains("is not a credential helper name"), "{e}");
    }
}
