//! The client against hostile peers (issue 14): a registry that hands its uploads and
//! downloads to another origin, a second local user at the lazy socket, an image built to
//! exhaust memory. Each test names what the component promises (`spec/transfer.md`,
//! `spec/lazy.md`, `spec/format.md`) and fails when the promise is broken.

use std::path::PathBuf;

use snapctl_tests::fault_proxy::{Fault, FaultProxy, Match, Rule};
use snapctl_tests::registry_support::{htpasswd, Serve};
use snapctl_tests::{run, snapctl, Run};

/// A scratch area with its own snapctl cache and Docker config (credentials).
struct Work {
    dir: tempfile::TempDir,
}

impl Work {
    fn new() -> Work {
        Work { dir: tempfile::tempdir().unwrap() }
    }
    fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }
    fn cmd(&self) -> std::process::Command {
        let mut c = snapctl();
        c.env("SNAPCTL_CACHE", self.path("cache")).env("DOCKER_CONFIG", self.path("docker"));
        c
    }
    fn ok(&self, args: &[&str]) -> Run {
        let r = run(self.cmd().args(args));
        assert_eq!(r.code, 0, "snapctl {args:?}: {r:?}");
        r
    }
    /// Store `user:password` for `host` in this area's Docker config.
    fn credentials(&self, host: &str, user: &str, password: &str) {
        use base64::Engine;
        let auth = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
        std::fs::create_dir_all(self.path("docker")).unwrap();
        std::fs::write(self.path("docker/config.json"), format!(r#"{{"auths":{{"{host}":{{"auth":"{auth}"}}}}}}"#)).unwrap();
    }
    /// A small sample snapshot packed into a layout; its `oci:` reference.
    fn packed(&self) -> String {
        let snap = self.path("snap");
        self.ok(&["sample", snap.to_str().unwrap(), "--size", "4MiB"]);
        let lay = self.path("layout");
        let r = format!("oci:{}:v1", lay.display());
        self.ok(&["pack", snap.to_str().unwrap(), &r]);
        r
    }
}

/// What the other origin saw carry an `Authorization` header.
fn credentials_seen(p: &FaultProxy) -> Vec<String> {
    p.log().iter().filter(|s| s.authorization.is_some()).map(|s| format!("{} {}: {}", s.method, s.target, s.authorization.as_deref().unwrap_or(""))).collect()
}

/// spec/transfer.md §1: credentials go only to the registry's origin. A registry that
/// wants Basic credentials answers the upload POST with a `Location` on another origin
/// (here a second listener, another port): the PATCH/PUT there carry no credentials,
/// and the push still completes (that server takes uploads without them).
#[test]
fn regression_issue_14_push_sends_no_basic_credentials_to_another_origin() {
    let store = tempfile::tempdir().unwrap();
    let upstream = Serve::start(store.path().to_str().unwrap(), &[], &[]);
    let registry = FaultProxy::start(upstream.addr.as_str()).unwrap();
    registry.require_basic("alice", "s3cret");
    let elsewhere = FaultProxy::start(upstream.addr.as_str()).unwrap();
    registry.add(Rule::new(Fault::MoveLocation { to: elsewhere.origin() }).on(Match::new("POST", "/blobs/uploads/")).times(u64::MAX));
    let w = Work::new();
    w.credentials(&registry.addr, "alice", "s3cret");
    let src = w.packed();
    let dest = format!("{}/adv/basic:v1", registry.addr);
    w.ok(&["push", &src, &dest]);
    assert!(elsewhere.log().iter().any(|s| s.method == "PUT"), "the uploads went to the other origin: {:?}", elsewhere.log());
    assert_eq!(credentials_seen(&elsewhere), Vec::<String>::new(), "credentials sent to another origin");
    assert!(registry.log().iter().any(|s| s.authorization.is_some()), "the registry itself got its credentials");
    w.ok(&["verify", &dest]);
}

/// The same with a token registry (`snapctl serve --htpasswd`: the Bearer flow). The
/// token belongs to the registry's origin too: the upload server gets none, refuses the
/// upload, and the push fails (exit 2) rather than hand the token on.
#[test]
fn regression_issue_14_push_sends_no_token_to_another_origin() {
    let store = tempfile::tempdir().unwrap();
    let pw = tempfile::tempdir().unwrap();
    htpasswd(&pw.path().join("htpasswd"), &[("alice", "s3cret")]);
    let upstream = Serve::start(store.path().to_str().unwrap(), &["--htpasswd", pw.path().join("htpasswd").to_str().unwrap()], &[]);
    let registry = FaultProxy::start(upstream.addr.as_str()).unwrap();
    let elsewhere = FaultProxy::start(upstream.addr.as_str()).unwrap();
    registry.add(Rule::new(Fault::MoveLocation { to: elsewhere.origin() }).on(Match::new("POST", "/blobs/uploads/")).times(u64::MAX));
    let w = Work::new();
    w.credentials(&registry.addr, "alice", "s3cret");
    let src = w.packed();
    let r = run(w.cmd().args(["push", &src, &format!("{}/adv/token:v1", registry.addr)]));
    assert!(!elsewhere.log().is_empty(), "the client was sent to the other origin: {r:?}");
    assert_eq!(credentials_seen(&elsewhere), Vec::<String>::new(), "token sent to another origin");
    assert!(registry.log().iter().any(|s| s.authorization.as_deref().is_some_and(|a| a.starts_with("Bearer "))), "the registry got its token");
    assert_eq!(r.code, 2, "the upload server wants credentials it must not get: {r:?}");
}

/// Redirected range reads (a registry sending blob GETs to a CDN) carry no credentials
/// either, and a pull through them still verifies every chunk.
#[test]
fn regression_issue_14_redirected_reads_carry_no_credentials() {
    let store = tempfile::tempdir().unwrap();
    let upstream = Serve::start(store.path().to_str().unwrap(), &[], &[]);
    let registry = FaultProxy::start(upstream.addr.as_str()).unwrap();
    registry.require_basic("alice", "s3cret");
    let cdn = FaultProxy::start(upstream.addr.as_str()).unwrap();
    let w = Work::new();
    w.credentials(&registry.addr, "alice", "s3cret");
    let src = w.packed();
    let dest = format!("{}/adv/redirect:v1", registry.addr);
    w.ok(&["push", &src, &dest]);
    registry.add(Rule::new(Fault::Redirect { code: 307, to: cdn.origin() }).on(Match::blob_gets()).times(u64::MAX));
    let out = w.path("out");
    w.ok(&["pull", &dest, out.to_str().unwrap(), "--cache", w.path("pull-cache").to_str().unwrap()]);
    assert!(cdn.log().iter().any(|s| s.method == "GET" && s.status == 206), "range reads went to the CDN: {:?}", cdn.log());
    assert_eq!(credentials_seen(&cdn), Vec::<String>::new(), "credentials sent to another origin");
    w.ok(&["verify", &dest, "--against", out.to_str().unwrap()]);
}
