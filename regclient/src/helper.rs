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
//!
//! A helper runs in a process group of its own and must exit within [`helper_timeout`]
//! (default [`DEFAULT_HELPER_TIMEOUT`], `SNAPCTL_CREDENTIAL_HELPER_TIMEOUT`); once it has
//! exited, whatever it left behind holding its output has [`EXIT_GRACE`] to let go. Past
//! either, the whole group is killed: a helper that never answers fails the command with
//! an error naming it, instead of hanging it silently.

use std::io::{Read as _, Write as _};
use std::os::unix::process::CommandExt as _;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::{Credentials, CredentialsError};

/// How long a helper may take by default (a keychain may ask its user to unlock it).
pub const DEFAULT_HELPER_TIMEOUT: Duration = Duration::from_secs(30);
/// After the helper exits, how long a process it left behind may keep its output open.
pub const EXIT_GRACE: Duration = Duration::from_secs(2);
/// Most bytes read of a helper's stdout or stderr (answers are a few hundred bytes).
const MAX_ANSWER: u64 = 1 << 20;

/// The helper timeout: `SNAPCTL_CREDENTIAL_HELPER_TIMEOUT` (`90s`, `2m`, or seconds),
/// else [`DEFAULT_HELPER_TIMEOUT`].
pub fn helper_timeout() -> Duration {
    crate::env_duration("SNAPCTL_CREDENTIAL_HELPER_TIMEOUT").unwrap_or(DEFAULT_HELPER_TIMEOUT)
}

/// What a finished helper said.
struct Output {
    status: std::process::ExitStatus,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
}

/// Why a helper gave no answer.
enum RunError {
    Spawn(std::io::Error),
    TimedOut,
}

/// Kill every process of the group `pgid` (the helper and what it started).
fn kill_group(pgid: u32) {
    if let Ok(pgid) = i32::try_from(pgid) {
        // SAFETY: kill(2) with a negative pid signals a process group; no memory involved.
        unsafe { libc::kill(-pgid, libc::SIGKILL) };
    }
}

/// Run `cmd` in a process group of its own with `input` on stdin, and collect its
/// output, within `timeout` (the helper's exit) and [`EXIT_GRACE`] (its output closing).
fn run_bounded(mut cmd: Command, input: &[u8], timeout: Duration) -> Result<Output, RunError> {
    let started = Instant::now();
    let mut child = cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).process_group(0).spawn().map_err(RunError::Spawn)?;
    let pgid = child.id();
    if let Some(mut stdin) = child.stdin.take() {
        // A helper that exits without reading its input fails this write (EPIPE); its exit
        // status and message say more. The input is far below a pipe's buffer: no block.
        let _ = stdin.write_all(input);
    }
    let (tx, rx) = mpsc::channel();
    for (i, pipe) in
        [child.stdout.take().map(|p| Box::new(p) as Box<dyn std::io::Read + Send>), child.stderr.take().map(|p| Box::new(p) as _)].into_iter().enumerate()
    {
        let tx = tx.clone();
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(p) = pipe {
                let _ = p.take(MAX_ANSWER).read_to_end(&mut buf);
            }
            let _ = tx.send((i, buf));
        });
    }
    drop(tx);
    let status = loop {
        match child.try_wait() {
            Ok(Some(st)) => break st,
            Ok(None) if started.elapsed() >= timeout => {
                kill_group(pgid);
                let _ = child.wait();
                return Err(RunError::TimedOut);
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => {
                kill_group(pgid);
                let _ = child.wait();
                return Err(RunError::Spawn(e));
            }
        }
    };
    let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
    let mut until = Instant::now() + EXIT_GRACE;
    let (mut killed, mut done) = (false, 0);
    while done < 2 {
        match rx.recv_timeout(until.saturating_duration_since(Instant::now())) {
            Ok((i, b)) => {
                done += 1;
                if i == 0 {
                    stdout = b;
                } else {
                    stderr = b;
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) if !killed => {
                // Something the helper started still holds its output: the answer is in.
                kill_group(pgid);
                killed = true;
                until = Instant::now() + Duration::from_secs(1);
            }
            Err(_) => break,
        }
    }
    Ok(Output { status, stdout, stderr })
}

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
        let mut cmd = Command::new(&program);
        cmd.arg(action);
        self.run(cmd, &program, action, input, helper_timeout())
    }

    /// [`Helper::call`] of the command `cmd` (`program` with its action), bounded by `timeout`.
    fn run(&self, cmd: Command, program: &str, action: &'static str, input: &[u8], timeout: Duration) -> Result<Outcome, CredentialsError> {
        let out = match run_bounded(cmd, input, timeout) {
            Ok(out) => out,
            Err(RunError::Spawn(source)) => {
                return Err(CredentialsError::HelperNotRun { program: program.into(), origin: self.origin.clone(), config: self.config.clone(), source })
            }
            Err(RunError::TimedOut) => {
                return Err(CredentialsError::HelperTimedOut {
                    program: program.into(),
                    action,
                    secs: timeout.as_secs_f64(),
                    origin: self.origin.clone(),
                    config: self.config.clone(),
                })
            }
        };
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

    /// A helper script at an absolute path (the unit tests do not touch PATH).
    fn script(dir: &std::path::Path, body: &str) -> Command {
        use std::os::unix::fs::PermissionsExt;
        let p = dir.join("docker-credential-fake");
        std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        // Run by sh, not executed itself: a file just written can be "busy" (ETXTBSY) while
        // another test thread's fork still holds the writer's descriptor before its exec.
        let mut c = Command::new("/bin/sh");
        c.arg(p).arg("get");
        c
    }

    fn fake() -> Helper {
        Helper { name: "fake".into(), origin: "credsStore".into(), config: "/home/u/.docker/config.json".into() }
    }

    /// Issue 21 §6: a helper that never answered hung `pull` silently. Now it is killed
    /// (with what it started) after the timeout, and the error names it.
    #[test]
    fn regression_issue_21_a_helper_that_never_answers_is_killed_and_named() {
        let dir = tempfile::tempdir().unwrap();
        let pidfile = dir.path().join("child.pid");
        let cmd = script(dir.path(), &format!("sleep 600 & echo $! > {}\nwait", pidfile.display()));
        let t = Instant::now();
        let e = match fake().run(cmd, "docker-credential-fake", "get", b"r.io", Duration::from_secs(1)) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("a helper that never answers answered"),
        };
        assert!(t.elapsed() < Duration::from_secs(5), "took {:?}", t.elapsed());
        assert!(e.starts_with("docker-credential-fake get did not answer within 1 s"), "{e}");
        assert!(e.contains("credsStore in /home/u/.docker/config.json"), "{e}");
        let pid: i32 = std::fs::read_to_string(&pidfile).unwrap().trim().parse().unwrap();
        std::thread::sleep(Duration::from_millis(100));
        // SAFETY: signal 0 only checks whether the process exists.
        let alive = unsafe { libc::kill(pid, 0) } == 0 && !std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default().contains(") Z ");
        assert!(!alive, "the helper's child {pid} outlived it");
    }

    /// Issue 21 §6: a helper that answered but left a child holding its stdout hung the
    /// reader waiting for end of file. Its answer is taken once it has exited, and what
    /// it left behind is killed after the grace period.
    #[test]
    fn regression_issue_21_a_child_holding_the_helpers_stdout_does_not_hang_it() {
        let dir = tempfile::tempdir().unwrap();
        let answer = r#"{"ServerURL":"r.io","Username":"alice","Secret":"pw"}"#;
        let cmd = script(dir.path(), &format!("cat >/dev/null\necho '{answer}'\nsleep 600 &\nexit 0"));
        let t = Instant::now();
        let out = fake().run(cmd, "docker-credential-fake", "get", b"r.io", Duration::from_secs(20));
        assert!(t.elapsed() < EXIT_GRACE + Duration::from_secs(2), "took {:?}", t.elapsed());
        match out {
            Ok(Outcome::Done(o)) => assert!(matches!(parse_get("x", &o), Ok(Some(Credentials::Password { .. })))),
            Ok(Outcome::Failed { status, message }) => panic!("{status}: {message}"),
            Err(e) => panic!("{e}"),
        }
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
