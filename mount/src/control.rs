//! The host daemon's control socket: one JSON request line, one JSON answer line.
//!
//! ```text
//! <host>.sock  (mode 0600, bound in a private directory then moved into place; every
//!               peer's SO_PEERCRED uid must be the daemon's before a byte is read)
//!   {"op":"add","reference":"oci:/l@sha256:…","dir":"/srv/vm1","prefetch":"trace"}
//!        -> {"ok":true,"name":"sha256:…","passthrough":"on"}
//!   {"op":"remove","dir":"/srv/vm1","busy":"refuse|wait|detach"} -> {"ok":true,"report":{…}}
//!   {"op":"wait","dir":"/srv/vm1"}  -> answered when that DIR is unmounted: {"ok":true,"report":{…}}
//!   {"op":"status"}                 -> {"ok":true,"binds":[{"dir":…,"name":…,"open_files":N}],"passthrough":"on"}
//!   any failure                     -> {"ok":false,"error":"one line"}
//! ```

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::{io_err, MountError, Report};

/// A request is at most this long (a reference and a path).
pub const MAX_REQUEST: u64 = 64 << 10;

/// What to do with a DIR whose image has files open or mapped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Busy {
    /// Refuse, naming how many files are open.
    #[default]
    Refuse,
    /// Wait until they are closed and unmapped.
    Wait,
    /// Detach DIR now (`umount -l`); the image goes once its files are closed.
    Detach,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    Add { reference: String, dir: PathBuf, prefetch: String },
    Remove { dir: PathBuf, busy: Busy },
    Wait { dir: PathBuf },
    Status,
}

/// One DIR the host shows an image in.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct BindStatus {
    pub dir: PathBuf,
    pub name: String,
    pub reference: String,
    pub open_files: u64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Response {
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub report: Option<Report>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub binds: Vec<BindStatus>,
    /// The host mount's passthrough: `on`, or `off: why` (the host's, whoever asks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub passthrough: Option<String>,
}

impl Response {
    pub fn failed(e: impl std::fmt::Display) -> Response {
        Response { ok: false, error: Some(e.to_string()), ..Response::default() }
    }
}

/// The control socket beside host mount `host`: `<host>.sock`.
pub fn socket_of(host: &Path) -> PathBuf {
    let mut s = host.as_os_str().to_os_string();
    s.push(".sock");
    PathBuf::from(s)
}

/// Send `req` to the daemon at `socket` and read its answer (`wait` answers late: no
/// deadline on the answer then).
pub fn call(socket: &Path, req: &Request) -> Result<Response, MountError> {
    let mut s = UnixStream::connect(socket).map_err(io_err(format!("connecting to {}", socket.display())))?;
    let mut line = serde_json::to_vec(req).map_err(|e| MountError::Refused(e.to_string()))?;
    line.push(b'\n');
    s.write_all(&line).map_err(io_err(format!("writing to {}", socket.display())))?;
    let mut answer = String::new();
    BufReader::new(s.take(MAX_REQUEST * 16)).read_line(&mut answer).map_err(io_err(format!("reading from {}", socket.display())))?;
    serde_json::from_str(&answer).map_err(|e| MountError::Refused(format!("{}: the daemon's answer does not parse ({e}): {answer:?}", socket.display())))
}

/// Whether a daemon answers at `socket`.
pub fn alive(socket: &Path) -> bool {
    UnixStream::connect(socket).is_ok()
}

/// Bind the control socket at `path`, mode 0600 whatever the umask: bound in a fresh
/// directory only the owner can enter, made 0600 there, then moved to `path` (a stale
/// socket there, which nothing answers, is replaced; a live one is refused).
pub fn listen(path: &Path) -> Result<UnixListener, MountError> {
    use std::os::unix::fs::{DirBuilderExt, FileTypeExt, PermissionsExt};
    if std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket()) {
        if alive(path) {
            return Err(MountError::Refused(format!("{}: another host mount daemon answers there", path.display())));
        }
        std::fs::remove_file(path).map_err(io_err(format!("removing the stale socket {}", path.display())))?;
    }
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let private = imgfmt::layout::tempname(dir, ".snapctl-mount");
    std::fs::DirBuilder::new().mode(0o700).create(&private).map_err(io_err(format!("creating {}", private.display())))?;
    let inner = private.join("s");
    let res = (|| {
        let l = UnixListener::bind(&inner)?;
        std::fs::set_permissions(&inner, std::fs::Permissions::from_mode(0o600))?;
        if std::fs::symlink_metadata(path).is_ok() {
            return Err(std::io::Error::from_raw_os_error(libc::EEXIST));
        }
        std::fs::rename(&inner, path)?;
        Ok(l)
    })();
    let _ = std::fs::remove_file(&inner);
    let _ = std::fs::remove_dir(&private);
    res.map_err(io_err(format!("binding {}", path.display())))
}

/// Whether the peer of `s` is this daemon's user (`SO_PEERCRED`), checked before a byte
/// it sent is read. A refusal is logged.
pub fn admit(s: &UnixStream) -> bool {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    use std::os::fd::AsRawFd;
    // SAFETY: `cred` and `len` are valid for writing and sized for SO_PEERCRED's answer.
    let rc = unsafe { libc::getsockopt(s.as_raw_fd(), libc::SOL_SOCKET, libc::SO_PEERCRED, (&mut cred as *mut libc::ucred).cast(), &mut len) };
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if rc != 0 {
        tracing::warn!("refusing a control connection whose credentials cannot be read: {}", std::io::Error::last_os_error());
        return false;
    }
    if cred.uid != me {
        tracing::warn!("refusing a control connection from uid {} gid {} pid {}: not the daemon's user (uid {me})", cred.uid, cred.gid, cred.pid);
        return false;
    }
    true
}

/// Read one request from an admitted peer (bounded, within a few seconds).
pub fn read_request(s: &UnixStream) -> Result<Request, String> {
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let mut line = String::new();
    BufReader::new(std::io::Read::take(s, MAX_REQUEST)).read_line(&mut line).map_err(|e| format!("reading the request: {e}"))?;
    serde_json::from_str(&line).map_err(|e| format!("a request that does not parse: {e}"))
}

/// Answer a request.
pub fn answer(mut s: &UnixStream, r: &Response) {
    let mut line = serde_json::to_vec(r).unwrap_or_else(|e| format!("{{\"ok\":false,\"error\":{:?}}}", e.to_string()).into_bytes());
    line.push(b'\n');
    let _ = s.write_all(&line);
}

use std::io::Read as _;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_as_the_spec_writes_them() {
        let r: Request = serde_json::from_str(r#"{"op":"remove","dir":"/srv/vm1","busy":"wait"}"#).unwrap();
        assert_eq!(r, Request::Remove { dir: "/srv/vm1".into(), busy: Busy::Wait });
        let a = Request::Add { reference: "oci:/l@sha256:00".into(), dir: "/d".into(), prefetch: "trace".into() };
        assert_eq!(serde_json::to_string(&a).unwrap(), r#"{"op":"add","reference":"oci:/l@sha256:00","dir":"/d","prefetch":"trace"}"#);
        assert_eq!(serde_json::to_string(&Response::failed("no")).unwrap(), r#"{"ok":false,"error":"no"}"#);
    }

    #[test]
    fn the_control_socket_is_private_and_a_live_one_is_not_replaced() {
        use std::os::unix::fs::PermissionsExt;
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("m.sock");
        let l = listen(&p).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().permissions().mode() & 0o777, 0o600);
        assert!(listen(&p).is_err(), "a live daemon's socket is kept");
        drop(l);
        listen(&p).expect("a stale socket is replaced");
    }
}
