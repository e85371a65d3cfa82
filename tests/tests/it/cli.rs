//! What a first user meets at the command line (issue 13 §2): a closed stdout, client
//! warnings on stderr, skopeo's `docker://` spelling, one duration grammar; errors that
//! say what to change, at once (issue 25 §2): unreachable registries, TLS on loopback, a
//! registry's own words, logins, request logs.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use std::time::{Duration, Instant};

use snapctl_tests::fault_proxy::{Fault, FaultProxy, Match, Rule};
use snapctl_tests::registry_support::{htpasswd, TestCa};
use snapctl_tests::{free_port, run, snapctl, Run, Work};

/// Steps of these tests beside [`Work`]'s own.
trait CliWork {
    /// `snapctl sample` of `size` into a new directory, packed as `oci:<dir>/l:<tag>`.
    fn packed(&self, name: &str, size: &str, tag: &str) -> (PathBuf, String);
}

impl CliWork for Work {
    fn packed(&self, name: &str, size: &str, tag: &str) -> (PathBuf, String) {
        let src = self.sample(name, size);
        let r = format!("oci:{}:{tag}", self.path("l").display());
        self.ok(&["pack", src.to_str().unwrap(), &r]);
        (src, r)
    }
}

/// Run `cmd` with stdout a pipe whose reading end is already closed (what `| head -n 3`
/// leaves once head has exited).
fn run_into_closed_pipe(cmd: &mut Command) -> Run {
    let (reader, writer) = std::io::pipe().expect("pipe");
    drop(reader);
    let out = cmd.stdin(Stdio::null()).stdout(writer).stderr(Stdio::piped()).output().expect("spawn");
    Run { code: out.status.code().unwrap_or(-1), stdout: String::new(), stderr: String::from_utf8_lossy(&out.stderr).into_owned() }
}

/// Issue 13: `snapctl inspect REF | head -n 3` panicked ("failed printing to stdout: Broken
/// pipe"). Every command that writes to stdout now ends quietly, status 0, when its reader
/// has gone: no panic, no error line.
#[test]
fn regression_issue_13_closed_stdout_ends_quietly_with_status_0() {
    let w = Work::new();
    let (src, a) = w.packed("snap", "2MiB", "a");
    w.ok(&["sample", src.to_str().unwrap(), "--size", "2MiB", "--mutate", "2"]);
    let b = format!("oci:{}:b", w.path("l").display());
    w.ok(&["pack", src.to_str().unwrap(), &b, "--parent", &a]);
    let s = w.serve("storage", &[]);
    let storage = w.path("storage");
    let remote = format!("{}/vm/pipe:v1", s.addr);
    w.ok(&["push", &a, &remote]);
    let (src_s, st, lay2) = (src.to_str().unwrap(), storage.to_str().unwrap(), format!("oci:{}:c", w.path("l2").display()));
    let commands: Vec<Vec<String>> = [
        &["inspect", &a][..],
        &["inspect", &a, "--json"],
        &["inspect", &remote],
        &["verify", &a, "--json"],
        &["diff", &a, &b],
        &["diff", &a, &b, "--json"],
        &["pack", src_s, &format!("oci:{}:p", w.path("l3").display())],
        &["pack", src_s, &format!("oci:{}:q", w.path("l3").display()), "--json"],
        &["unpack", &a, w.path("out1").to_str().unwrap(), "--json"],
        &["copy", &a, &lay2, "--json"],
        &["push", &b, &format!("{}/vm/pipe:v2", s.addr)],
        &["push", &b, &format!("{}/vm/pipe2:v2", s.addr), "--json"],
        &["pull", &remote, w.path("out2").to_str().unwrap(), "--json"],
        &["gc", "--storage", st, "--dry-run"],
        &["gc", "--storage", st, "--dry-run", "--json"],
        &["--help"],
        &["inspect", "--help"],
        &["--version"],
    ]
    .iter()
    .map(|c| c.iter().map(|s| s.to_string()).collect())
    .collect();
    for c in &commands {
        let r = run_into_closed_pipe(w.cmd().args(c));
        assert!(!r.stderr.contains("panicked"), "snapctl {c:?} panicked on a closed stdout: {}", r.stderr);
        assert!(!r.stderr.contains("Broken pipe") && !r.stderr.contains("snapctl:"), "snapctl {c:?}: an error line for a closed stdout: {}", r.stderr);
        assert_eq!(r.code, 0, "snapctl {c:?} on a closed stdout: {r:?}");
    }
    // The same commands still print in full to an open stdout.
    let r = w.ok(&["inspect", &a]);
    assert!(r.stdout.lines().count() > 5 && r.stdout.contains("total"), "{r:?}");
}

/// The pack of `sample 2MiB` is bigger than this, so its upload goes in several PATCHes and
/// saves resume state after each one.
const SMALL_PIECE: &str = "64KiB";

/// Issue 13: only `serve` installed a log subscriber, so a library's warning in a client
/// command went nowhere. Push with an upload-state directory that cannot be created: the
/// registry client's `tracing::warn!` reaches stderr by default; `SNAPCTL_LOG`, then
/// `RUST_LOG`, set the level.
#[test]
fn regression_issue_13_client_warnings_reach_stderr() {
    let w = Work::new();
    let (_, a) = w.packed("snap", "2MiB", "a");
    let s = w.serve("storage", &[]);
    let push = |n: u32, env: &[(&str, &str)]| -> Run {
        // A fresh cache per push (so nothing is mounted from an earlier repository), where
        // `uploads` is a file: the resume state cannot be saved.
        let cache = w.path(&format!("cache{n}"));
        std::fs::create_dir_all(&cache).unwrap();
        std::fs::write(cache.join("uploads"), b"not a directory").unwrap();
        let mut c = w.cmd();
        c.args(["push", &a, &format!("{}/vm/log{n}:v1", s.addr), "--upload-piece", SMALL_PIECE, "--cache", cache.to_str().unwrap()]);
        for (k, v) in env {
            c.env(k, v);
        }
        let r = run(&mut c);
        assert_eq!(r.code, 0, "a push whose resume state cannot be saved still completes: {r:?}");
        r
    };
    let warned = |r: &Run| r.stderr.contains("cannot save upload state");
    let r = push(1, &[]);
    assert!(warned(&r), "the warning reaches stderr by default: {}", r.stderr);
    assert!(r.stderr.contains("WARN"), "with its level: {}", r.stderr);
    assert_eq!(r.stderr.matches("cannot save upload state").count(), 1, "once per blob, not once per piece: {}", r.stderr);
    let r = push(2, &[("SNAPCTL_LOG", "error")]);
    assert!(!warned(&r), "SNAPCTL_LOG=error silences it: {}", r.stderr);
    let r = push(3, &[("RUST_LOG", "error")]);
    assert!(!warned(&r), "RUST_LOG=error silences it: {}", r.stderr);
    let r = push(4, &[("SNAPCTL_LOG", "warn"), ("RUST_LOG", "error")]);
    assert!(warned(&r), "SNAPCTL_LOG wins over RUST_LOG: {}", r.stderr);
}

/// Issue 13: skopeo spells a registry reference `docker://HOST/REPO:TAG`; snapctl refused it
/// with a name-grammar error. It is accepted wherever a reference is.
#[test]
fn regression_issue_13_docker_transport_prefix_is_a_registry_reference() {
    let w = Work::new();
    let (_, a) = w.packed("snap", "2MiB", "a");
    let s = w.serve("storage", &[]);
    let remote = format!("docker://{}/vm/skopeo:v1", s.addr);
    let pushed = w.ok(&["push", &a, &remote]).stdout;
    let r = w.ok(&["inspect", &remote, "--json"]);
    let j: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    assert_eq!(j["manifest"].as_str().unwrap(), pushed.trim());
    w.ok(&["verify", &remote]);
    w.ok(&["copy", &remote, &format!("docker://{}/vm/skopeo2:v1", s.addr)]);
    w.ok(&["pull", &format!("docker://{}/vm/skopeo2:v1", s.addr), w.path("out").to_str().unwrap()]);
    // Docker Hub short names are not guessed: the message says what to write.
    let r = run(w.cmd().args(["inspect", "docker://alpine:3"]));
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("docker://HOST[:PORT]/REPO"), "says what to write: {}", r.stderr);
}

fn gc_json(storage: &Path, extra: &[&str]) -> Run {
    run(snapctl().args(["gc", "--storage", storage.to_str().unwrap(), "--json", "--dry-run"]).args(extra))
}

/// Issue 13: `gc --grace 500ms` and `lazy --retry-budget 1h` were refused: two duration
/// grammars. One parser takes ms, s, m, h, d and combinations for every duration flag.
#[test]
fn regression_issue_13_one_duration_grammar_for_every_flag() {
    let w = Work::new();
    let storage = w.path("storage");
    std::fs::create_dir_all(&storage).unwrap();
    for d in ["500ms", "90s", "1h", "1h30m", "7d", "0", "120"] {
        let r = gc_json(&storage, &["--grace", d, "--upload-ttl", d]);
        assert_eq!(r.code, 0, "gc --grace {d}: {r:?}");
    }
    let r = gc_json(&storage, &["--grace", "soon"]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("--grace") && r.stderr.contains("1h30m"), "names the flag and an example: {}", r.stderr);

    // lazy: the duration is accepted, so the command gets as far as opening the image.
    let missing = format!("oci:{}", w.path("missing").display());
    for d in ["1h", "500ms", "2m", "1h30m", "120"] {
        let r = run(snapctl().args(["lazy", &missing, "--socket", w.path("s.sock").to_str().unwrap(), "--retry-budget", d]));
        assert_eq!(r.code, 2, "{r:?}");
        assert!(!r.stderr.contains("invalid value"), "lazy --retry-budget {d} is accepted: {}", r.stderr);
        assert!(r.stderr.contains("missing"), "fails on the missing image instead: {}", r.stderr);
    }
    let r = run(snapctl().args(["lazy", &missing, "--socket", "x", "--retry-budget=-1s"]));
    assert!(r.code == 2 && r.stderr.contains("invalid value"), "{r:?}");
    // The help texts say what is accepted.
    for (cmd, flag) in [("gc", "--grace"), ("lazy", "--retry-budget")] {
        let r = run(snapctl().args([cmd, "--help"]));
        let line = r.stdout.lines().skip_while(|l| !l.trim_start().starts_with(flag)).take(4).collect::<Vec<_>>().join(" ");
        assert!(line.contains("ms") && line.contains("1h30m"), "{cmd} --help documents the grammar: {line}");
    }
}

/// Issue 22: an error of several lines (a TOML error draws the line it could not read
/// under its message) was printed as one line with `\n` spelled out. Its lines are
/// lines again, each after the first indented (no line of an error can pass for a
/// `snapctl:` or `hint:` line of its own), and nothing is spelled as an escape.
#[test]
fn regression_issue_22_multi_line_errors_print_as_lines() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("registry.toml");
    std::fs::write(&config, "storage = \"./s\"\nno_such_key = 1\n").unwrap();
    for cmd in ["serve", "gc"] {
        let r = run(snapctl().args([cmd, "--config", config.to_str().unwrap()]));
        assert_eq!(r.code, 2, "{r:?}");
        assert!(!r.stderr.contains("\\n"), "{cmd}: a newline spelled out: {}", r.stderr);
        let lines: Vec<&str> = r.stderr.lines().collect();
        assert!(lines.len() >= 3, "{cmd}: the error's own lines: {}", r.stderr);
        assert!(lines[0].starts_with("snapctl: ") && lines[0].contains("not a valid configuration"), "{cmd}: {}", r.stderr);
        assert!(lines[1..].iter().all(|l| l.starts_with("  ")), "{cmd}: further lines indented: {}", r.stderr);
        assert!(lines.iter().any(|l| l.contains("no_such_key = 1")), "{cmd}: the line it could not read: {}", r.stderr);
    }
}

/// The two lines a command that could not reach a registry prints: the error, then the
/// flag or check that fixes it.
fn error_and_hint(r: &Run) -> (&str, &str) {
    let lines: Vec<&str> = r.stderr.lines().collect();
    assert_eq!(lines.len(), 2, "one error line and one hint line: {r:?}");
    assert!(lines[0].starts_with("snapctl: ") && lines[1].starts_with("hint: "), "{r:?}");
    (lines[0], lines[1])
}

/// Issue 25 §2: a refused connection and an unknown host were retried 5 times with
/// backoff (7.5 s) and then said "resolving X: resolving X: gave up after 6 attempts:
/// error sending request for url (…): client error (Connect): tcp connect error: …".
/// Neither is fixed by waiting on a registry that never answered: the command fails at
/// once (no retry in the debug log, well under the policy's 6.2 s of backoff) with one
/// line that says so and a hint.
#[test]
fn regression_issue_25_unreachable_registries_fail_at_once_with_a_hint() {
    let w = Work::new();
    let nobody = format!("127.0.0.1:{}", free_port());
    let out = w.path("out");
    for (reference, says, hint) in [
        (format!("{nobody}/vm/x:v1"), format!("cannot reach {nobody}: connection refused"), format!("is the registry running, and listening on {nobody}?")),
        ("nosuch.invalid/vm/x:v1".to_string(), "cannot reach nosuch.invalid: no such host".into(), "check the registry's name".into()),
    ] {
        for args in [vec!["inspect", &reference], vec!["pull", &reference, out.to_str().unwrap()], vec!["copy", &reference, "oci:/nonexistent/x:v1"]] {
            let t0 = Instant::now();
            let r = run(w.cmd().args(&args));
            let took = t0.elapsed();
            assert_eq!(r.code, 2, "{args:?}: {r:?}");
            let (error, h) = error_and_hint(&r);
            assert!(error.contains(&says), "{args:?}: {error}");
            assert_eq!(error.matches(&reference).count(), 1, "{args:?}: the line repeats itself: {error}");
            assert!(h.contains(&hint), "{args:?}: {h}");
            assert!(took < Duration::from_secs(5), "{args:?}: {took:?}: waited as for a retry");
            let r = run(w.cmd().args(&args).env("SNAPCTL_LOG", "debug"));
            assert!(!r.stderr.contains("retry"), "{args:?}: retried: {}", r.stderr);
        }
    }
    assert!(!out.exists(), "nothing created for a pull that could not start");
}

/// Issue 25 §2: `snapctl serve --tls-cert` on 127.0.0.1 was unusable from the client
/// (plain HTTP for loopback, no way to trust its certificate). A TLS flag (`--ca-file`,
/// `--insecure`, skopeo's `--tls-verify`) makes a loopback registry HTTPS; push, pull,
/// verify and copy work with the CA, or with SSL_CERT_FILE; without it each mismatch
/// fails at once with the flag that fixes it.
#[test]
fn regression_issue_25_tls_on_loopback_with_a_ca_file() {
    let Some(ca) = TestCa::make() else { return };
    let w = Work::new();
    let (_, a) = w.packed("snap", "2MiB", "a");
    let s = w.serve("storage", &["--tls-cert", ca.cert.to_str().unwrap(), "--tls-key", ca.key.to_str().unwrap()]);
    let remote = format!("{}/vm/tls:v1", s.addr);
    let ca_file = ca.ca.to_str().unwrap();

    // Plain HTTP (a loopback registry's default) to a TLS registry.
    let r = run(w.cmd().args(["push", &a, &remote]));
    assert_eq!(r.code, 2, "{r:?}");
    let (error, hint) = error_and_hint(&r);
    assert!(error.contains(&format!("cannot reach {}", s.addr)) && error.contains("speaks HTTPS"), "{error}");
    assert!(hint.contains("--ca-file FILE") && hint.contains("--insecure"), "{hint}");
    // HTTPS, but a certificate nobody said to trust.
    let r = run(w.cmd().args(["push", &a, &remote, "--tls-verify=true"]));
    assert_eq!(r.code, 2, "{r:?}");
    let (error, hint) = error_and_hint(&r);
    assert!(error.contains("certificate is not trusted") && error.contains("UnknownIssuer"), "{error}");
    assert!(hint.contains("--ca-file FILE") && hint.contains("SSL_CERT_FILE"), "{hint}");

    // With the CA: everything works.
    let pushed = w.ok(&["push", &a, &remote, "--ca-file", ca_file]).stdout;
    w.ok(&["pull", &remote, w.path("out").to_str().unwrap(), "--ca-file", ca_file]);
    w.ok(&["verify", &remote, "--ca-file", ca_file]);
    w.ok(&["copy", &remote, &format!("{}/vm/tls2:v1", s.addr), "--ca-file", ca_file]);
    // The CA as OpenSSL takes it, from the environment.
    let r = run(w.cmd().env("SSL_CERT_FILE", ca_file).args(["inspect", &remote, "--tls-verify=true", "--json"]));
    assert_eq!(r.code, 0, "{r:?}");
    assert!(r.stdout.contains(pushed.trim()), "{r:?}");
    let r = run(w.cmd().env("SSL_CERT_DIR", ca.ca.parent().unwrap()).args(["inspect", &remote, "--tls-verify=true"]));
    assert_eq!(r.code, 0, "{r:?}");
    // No check at all, for a test registry.
    w.ok(&["inspect", &remote, "--insecure"]);
    w.ok(&["inspect", &format!("localhost:{}/vm/tls:v1", s.addr.rsplit_once(':').unwrap().1), "--tls-verify=false"]);

    // HTTPS to a plain registry.
    let p = w.serve("plain", &[]);
    let r = run(w.cmd().args(["inspect", &format!("{}/vm/x:v1", p.addr), "--insecure"]));
    assert_eq!(r.code, 2, "{r:?}");
    let (error, hint) = error_and_hint(&r);
    assert!(error.contains("does not speak TLS"), "{error}");
    assert_eq!(hint, "hint: pass --plain-http");
    // The flags that contradict each other are refused by name.
    let r = run(w.cmd().args(["inspect", &remote, "--plain-http", "--ca-file", ca_file]));
    assert!(r.code == 2 && r.stderr.contains("--plain-http") && r.stderr.contains("cannot be used with"), "{r:?}");
}

/// Issue 23 §3 (wake): every registry client read the system's TLS roots when it was built
/// (a bundle and a directory of ~150 files, each parsed), and `snapctl lazy` builds three
/// before it binds its socket, so a plain-HTTP registry's restore paid it three times
/// over. The roots are now read at the first TLS handshake, once per process. Seen from
/// outside: a system store that does not parse (one broken certificate) stopped even a
/// plain-HTTP command ("builder error"); now only a TLS handshake would read it.
#[test]
fn regression_issue_23_a_plain_http_registry_never_reads_the_tls_roots() {
    let w = Work::new();
    let (_, a) = w.packed("snap", "2MiB", "a");
    let s = w.serve("storage", &[]);
    let remote = format!("{}/vm/plain:v1", s.addr);
    let pushed = w.ok(&["push", &a, &remote]).stdout;
    let (bad, empty) = (w.path("bad.pem"), w.path("no-certs"));
    std::fs::write(&bad, "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n").unwrap();
    std::fs::create_dir_all(&empty).unwrap();
    let r = run(w.cmd().env("SSL_CERT_FILE", &bad).env("SSL_CERT_DIR", &empty).args(["inspect", &remote, "--json"]));
    assert_eq!(r.code, 0, "{r:?}");
    assert!(r.stdout.contains(pushed.trim()), "{r:?}");
}

/// Issue 25 §2: a registry's 500 reached the user as "HTTP 500 Internal Server Error";
/// what it said (here "No space left on device") is lost. It now ends the error line,
/// and the upload the push gave up is deleted at the registry rather than left for it to
/// expire.
#[test]
fn regression_issue_25_the_registrys_words_reach_the_user() {
    let w = Work::new();
    let (_, a) = w.packed("snap", "2MiB", "a");
    let s = w.serve("storage", &[]);
    let proxy = FaultProxy::start(s.addr.as_str()).unwrap();
    let full = "write /srv/registry/_uploads/x: No space left on device";
    proxy.add(Rule::new(Fault::StatusSaying { code: 500, message: full.into() }).on(Match::new("PUT", "/blobs/uploads/")).times(u64::MAX));
    let r = run(w.cmd().args(["push", &a, &format!("{}/vm/full:v1", proxy.addr), "--jobs", "1"]));
    assert_eq!(r.code, 2, "{r:?}");
    let line = r.stderr.lines().find(|l| l.starts_with("snapctl: ")).unwrap_or_default();
    assert!(line.contains("gave up after 6 attempts") && line.ends_with(&format!("HTTP 500 Internal Server Error: UNAVAILABLE: {full}")), "{r:?}");
    let log = proxy.log();
    let deleted = log.iter().filter(|l| l.method == "DELETE" && l.target.contains("/blobs/uploads/")).count();
    assert_eq!(deleted, 1, "the session given up is deleted: {:?}", log.iter().map(|l| format!("{} {}", l.method, l.target)).collect::<Vec<_>>());
}

/// Issue 25 §2: `SNAPCTL_LOG=debug` showed nothing of the requests. Every request is one
/// line (method, URL, range, status, time to the response head) and every retry another.
#[test]
fn regression_issue_25_debug_log_has_a_line_per_request_and_retry() {
    let w = Work::new();
    let (_, a) = w.packed("snap", "2MiB", "a");
    let s = w.serve("storage", &[]);
    let remote = format!("{}/vm/log:v1", s.addr);
    w.ok(&["push", &a, &remote]);
    let proxy = FaultProxy::start(s.addr.as_str()).unwrap();
    // Config and index are the first two blob GETs; the first pack range gets a 503.
    proxy.add(Rule::new(Fault::Status { code: 503 }).on(Match::blob_gets()).nth(3));
    let r = run(w.cmd().env("SNAPCTL_LOG", "debug").args(["pull", &format!("{}/vm/log:v1", proxy.addr), w.path("out").to_str().unwrap(), "--no-cache"]));
    assert_eq!(r.code, 0, "{r:?}");
    let lines: Vec<&str> = r.stderr.lines().collect();
    let base = format!("http://{}/v2/vm/log/", proxy.addr);
    let request = |method: &str, path: &str, status: u16| {
        lines.iter().any(|l| l.starts_with(&format!("DEBUG {method} {base}{path}")) && l.contains(&format!(" -> {status} in ")) && l.ends_with(" ms"))
    };
    assert!(request("GET", "manifests/v1", 200), "{}", r.stderr);
    assert!(request("GET", "blobs/sha256:", 200), "{}", r.stderr);
    assert!(lines.iter().any(|l| l.contains("/blobs/sha256:") && l.contains(" bytes=") && l.contains(" -> 206 in ")), "ranges are named: {}", r.stderr);
    assert!(lines.iter().any(|l| l.contains(" bytes=") && l.contains(" -> 503 in ")), "{}", r.stderr);
    assert!(lines.iter().any(|l| l.contains("HTTP 503") && l.contains("; retry 1 in ") && l.ends_with(" ms")), "the retry: {}", r.stderr);
}

/// Run `cmd` with its stdin and stderr on a new pseudo-terminal that is its controlling
/// terminal (what a person's shell gives it); `typed` is typed once `prompt` appears.
/// Returns the exit code and everything the terminal showed.
fn on_a_terminal(mut cmd: Command, prompt: &str, typed: &str) -> (i32, String) {
    use std::io::{Read, Write};
    use std::os::fd::{FromRawFd, OwnedFd};
    use std::os::unix::process::CommandExt;
    let (mut master, mut slave) = (0, 0);
    // SAFETY: openpty writes two descriptors into the integers given; the name, termios
    // and window size arguments may be null.
    let rc = unsafe { libc::openpty(&mut master, &mut slave, std::ptr::null_mut(), std::ptr::null(), std::ptr::null()) };
    assert_eq!(rc, 0, "openpty: {}", std::io::Error::last_os_error());
    // SAFETY: both descriptors were just opened and are owned by nothing else.
    let (master, slave) = unsafe { (std::fs::File::from(OwnedFd::from_raw_fd(master)), OwnedFd::from_raw_fd(slave)) };
    cmd.stdin(slave.try_clone().unwrap()).stderr(slave.try_clone().unwrap()).stdout(Stdio::null());
    // SAFETY: setsid and ioctl are async-signal-safe; the child makes the terminal on its
    // stdin its controlling terminal, so /dev/tty is that terminal.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().expect("spawn");
    // The terminal's last other holders: the reader sees EIO once the child exits.
    drop(cmd);
    drop(slave);
    let shown = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let (mut reader, s2) = (master.try_clone().unwrap(), shown.clone());
    let t = std::thread::spawn(move || {
        let mut b = [0u8; 4096];
        // EIO once the child has closed the terminal.
        while let Ok(n @ 1..) = reader.read(&mut b) {
            s2.lock().unwrap().push_str(&String::from_utf8_lossy(&b[..n]));
        }
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    while !shown.lock().unwrap().contains(prompt) {
        assert!(Instant::now() < deadline, "no prompt {prompt:?}: {:?}", shown.lock().unwrap());
        if let Ok(Some(st)) = child.try_wait() {
            panic!("exited with {st} before prompting: {:?}", shown.lock().unwrap());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // The prompt is written before echo goes off: type once it is off, as a person would.
    let echo_on = || {
        use std::os::fd::AsRawFd;
        // SAFETY: a termios is plain integers; all zeros is a value, overwritten below.
        let mut t: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: tcgetattr fills `t` from the open master descriptor.
        let rc = unsafe { libc::tcgetattr(master.as_raw_fd(), &mut t) };
        rc != 0 || t.c_lflag & libc::ECHO != 0
    };
    while echo_on() {
        assert!(Instant::now() < deadline, "echo never went off: {:?}", shown.lock().unwrap());
        std::thread::sleep(Duration::from_millis(20));
    }
    (&master).write_all(format!("{typed}\r").as_bytes()).unwrap();
    let code = child.wait().unwrap().code().unwrap_or(-1);
    drop(master);
    let _ = t.join();
    let s = shown.lock().unwrap().clone();
    (code, s)
}

/// Issue 25 §2: `login` without --password-stdin refused to ask ("give the password on
/// stdin"), and a wrong password said "run `snapctl login`", the command just run. On a
/// terminal it asks, without echo; a wrong password says so.
#[test]
fn regression_issue_25_login_asks_on_a_terminal_and_names_a_wrong_password() {
    let w = Work::new();
    let pw = w.path("htpasswd");
    htpasswd(&pw, &[("alice", "s3cret")]);
    let s = w.serve("storage", &["--htpasswd", pw.to_str().unwrap()]);
    let prompt = format!("Password for alice at {}: ", s.addr);

    let login = || {
        let mut c = w.cmd();
        c.args(["login", &s.addr, "-u", "alice"]);
        c
    };
    let (code, shown) = on_a_terminal(login(), &prompt, "wrong");
    assert_eq!(code, 2, "{shown}");
    assert!(shown.contains(&format!("snapctl: login to {} as alice failed: wrong user or password for {}", s.addr, s.addr)), "{shown}");
    assert!(!shown.contains("snapctl login"), "no hint to run the command just run: {shown}");
    assert!(!shown.contains(&format!("{prompt}wrong")), "the password was echoed: {shown:?}");

    let (code, shown) = on_a_terminal(login(), &prompt, "s3cret");
    assert_eq!(code, 0, "{shown}");
    assert!(!shown.contains("s3cret"), "the password was echoed: {shown:?}");
    assert!(shown.contains(&format!("logged in to {} as alice", s.addr)), "{shown}");
    w.ok(&["push", &w.packed("snap", "2MiB", "a").1, &format!("{}/vm/in:v1", s.addr)]);

    // Piped, the same wrong password says the same; with no terminal and no
    // --password-stdin there is nobody to ask.
    let mut c = w.cmd();
    c.args(["login", &s.addr, "-u", "alice", "--password-stdin"]).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = c.spawn().unwrap();
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), b"nope\n").unwrap();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(err.trim_end(), format!("snapctl: login to {} as alice failed: wrong user or password for {}", s.addr, s.addr));
    let r = run(w.cmd().args(["login", &s.addr, "-u", "alice"]).stdin(Stdio::null()));
    assert!(r.code == 2 && r.stderr.contains("--password-stdin"), "{r:?}");
}

/// The Go oras CLI that scripts/install-trixie.sh puts in its own prefix, if it is there
/// (skip loudly, or fail under SNAPCTL_REQUIRE_PEERS=1, when not).
fn oras() -> Option<PathBuf> {
    let p = PathBuf::from(std::env::var_os("SNAPCTL_ORAS_PREFIX").unwrap_or_else(|| "/opt/snapctl-oras".into())).join("oras");
    if p.is_file() {
        return Some(p);
    }
    assert!(!snapctl_tests::require_peers(), "oras is required (SNAPCTL_REQUIRE_PEERS=1) but {} is missing; run scripts/setup.sh --tests", p.display());
    eprintln!("SKIP: no oras at {}", p.display());
    None
}

/// Issue 25 §3: `inspect` of an artifact that is not a snapshot (an SBOM pushed by oras, a
/// signature attached to a snapshot) exited 1, "verification said no", with "not a
/// snapctl image". It describes it, exit 0: media type, artifact type, subject, layers.
#[test]
fn regression_issue_25_inspect_describes_other_artifacts() {
    let Some(oras) = oras() else { return };
    let w = Work::new();
    let (_, a) = w.packed("snap", "2MiB", "a");
    let s = w.serve("storage", &[]);
    let remote = format!("{}/vm/art:v1", s.addr);
    let snapshot = w.ok(&["push", &a, &remote]).stdout.trim().to_string();
    std::fs::write(w.path("sbom.spdx.json"), br#"{"spdxVersion":"SPDX-2.3"}"#).unwrap();
    let oras_run = |args: &[&str]| {
        let r = run(Command::new(&oras).current_dir(w.path("")).env("DOCKER_CONFIG", w.path("docker")).args(args));
        assert_eq!(r.code, 0, "oras {args:?}: {r:?}");
        r
    };
    oras_run(&["push", "--plain-http", "--artifact-type", "application/spdx+json", &format!("{}/vm/sbom:v1", s.addr), "sbom.spdx.json:application/spdx+json"]);
    oras_run(&["attach", "--plain-http", "--artifact-type", "application/vnd.example.signature", &remote, "sbom.spdx.json:application/spdx+json"]);

    let r = w.ok(&["inspect", &format!("{}/vm/sbom:v1", s.addr)]);
    assert!(r.stdout.contains("artifact type application/spdx+json") && r.stdout.contains("sbom.spdx.json"), "{r:?}");
    assert!(r.stdout.contains("snapshot      no"), "{r:?}");
    let j: serde_json::Value = serde_json::from_str(&w.ok(&["inspect", &format!("{}/vm/sbom:v1", s.addr), "--json"]).stdout).unwrap();
    assert_eq!(j["snapshot"], false);
    assert_eq!(j["artifact_type"], "application/spdx+json");
    assert_eq!(j["layers"][0]["media_type"], "application/spdx+json");
    assert_eq!(j["layers"][0]["title"], "sbom.spdx.json");
    assert_eq!(j["layers"][0]["size_bytes"], std::fs::metadata(w.path("sbom.spdx.json")).unwrap().len());

    // The attached artifact, found by its subject's referrers (through the registry's API).
    let c = reqwest::blocking::Client::new();
    let refs: serde_json::Value = c.get(s.url(&format!("/v2/vm/art/referrers/{snapshot}"))).send().unwrap().json().unwrap();
    let sig = refs["manifests"][0]["digest"].as_str().unwrap().to_string();
    let j: serde_json::Value = serde_json::from_str(&w.ok(&["inspect", &format!("{}/vm/art@{sig}", s.addr), "--json"]).stdout).unwrap();
    assert_eq!(j["artifact_type"], "application/vnd.example.signature");
    assert_eq!(j["subject"]["digest"], snapshot.as_str());
    let r = w.ok(&["inspect", &format!("{}/vm/art@{sig}", s.addr)]);
    assert!(r.stdout.contains(&format!("subject       {snapshot}")), "{r:?}");
    // A snapshot is still a snapshot, and a damaged one still exits 1 (tested elsewhere).
    let j: serde_json::Value = serde_json::from_str(&w.ok(&["inspect", &remote, "--json"]).stdout).unwrap();
    assert_eq!(j["manifest"], snapshot.as_str());
}

/// Issue 25 §3: `sample --mutate` on a missing directory created it (empty) before
/// failing; `pack` of an empty directory wrote an image of no file.
#[test]
fn regression_issue_25_sample_mutate_and_pack_refuse_nothing_to_work_on() {
    let w = Work::new();
    let missing = w.path("missing");
    let r = run(w.cmd().args(["sample", missing.to_str().unwrap(), "--mutate", "3"]));
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("no sample to mutate"), "{r:?}");
    assert!(!missing.exists(), "created the directory it could not mutate");
    let empty = w.path("empty");
    std::fs::create_dir_all(empty.join("sub")).unwrap();
    let layout = w.path("l");
    for args in [vec!["pack", empty.to_str().unwrap(), &format!("oci:{}:v1", layout.display())], vec!["push", empty.to_str().unwrap(), "127.0.0.1:1/vm/x:v1"]] {
        let r = run(w.cmd().args(&args));
        assert_eq!(r.code, 2, "{args:?}: {r:?}");
        assert!(r.stderr.contains("nothing to pack: no regular file in it"), "{args:?}: {r:?}");
    }
    assert!(!layout.exists(), "a layout was created for nothing");
}

/// Issue 25 §3: `--version` said "snapctl 0.1.0" whatever it was built from; completions
/// and man pages had to be written by hand. The version names the commit, and both are
/// generated from the CLI's own definition.
#[test]
fn regression_issue_25_version_names_the_commit_and_completions_and_man_pages_exist() {
    let w = Work::new();
    let v = w.ok(&["--version"]).stdout;
    let commit = v.trim().strip_prefix(&format!("snapctl {} (commit ", env!("CARGO_PKG_VERSION"))).and_then(|c| c.strip_suffix(')'));
    let commit = commit.unwrap_or_else(|| panic!("{v:?}"));
    assert!(commit == "unknown" || (commit.len() == 12 && commit.bytes().all(|b| b.is_ascii_hexdigit())), "{v:?}");
    for (shell, says) in
        [("bash", "complete -F _snapctl"), ("zsh", "#compdef snapctl"), ("fish", "complete -c snapctl"), ("elvish", "snapctl"), ("powershell", "snapctl")]
    {
        let r = w.ok(&["completions", shell]);
        assert!(r.stdout.contains(says), "{shell}: {}", &r.stdout[..r.stdout.len().min(300)]);
        assert!(r.stdout.contains("ca-file"), "{shell}: the flags are in it");
    }
    let r = w.ok(&["man"]);
    assert!(r.stdout.contains(".TH snapctl 1") && r.stdout.contains("snapctl\\-push(1)"), "{}", &r.stdout[..r.stdout.len().min(500)]);
    let dir = w.path("man1");
    w.ok(&["man", "--dir", dir.to_str().unwrap()]);
    for page in ["snapctl.1", "snapctl-push.1", "snapctl-pull.1", "snapctl-inspect.1", "snapctl-completions.1"] {
        let text = std::fs::read_to_string(dir.join(page)).unwrap_or_else(|e| panic!("{page}: {e}"));
        assert!(text.contains(".TH"), "{page}");
    }
    assert!(std::fs::read_to_string(dir.join("snapctl-pull.1")).unwrap().contains("ca\\-file"), "the page has the flags");
}

/// `$SNAPCTL_CACHE_SIZE` set for every command made `pull --no-cache` a usage error (the
/// variable counted as a `--cache-size` given beside it). The host cache flags are one
/// definition now: pull, lazy and mount take `--no-cache` with a budget from the
/// environment, read nothing from the cache and add nothing to it, and refuse it only
/// beside `--cache DIR`.
#[test]
fn no_cache_with_a_budget_from_the_environment_pulls_without_the_cache() {
    let w = Work::new();
    let (src, r) = w.packed("snap", "2MiB", "v1");
    let out = w.path("out");
    let pulled = run(w.cmd().env("SNAPCTL_CACHE_SIZE", "1GiB").args(["pull", &r, out.to_str().unwrap(), "--no-cache"]));
    assert_eq!(pulled.code, 0, "{pulled:?}");
    assert_eq!(std::fs::read(out.join("vm.mem")).unwrap(), std::fs::read(src.join("vm.mem")).unwrap());
    assert!(!w.cache().join("chunks").exists(), "--no-cache added to the cache");
    for args in [vec!["pull", &r, "out2"], vec!["lazy", &r, "--socket", "s"], vec!["mount", &r, "dir"]] {
        let refused = run(w.cmd().env("SNAPCTL_CACHE_SIZE", "1GiB").args(&args).args(["--no-cache", "--cache", "/c"]));
        assert_eq!(refused.code, 2, "{args:?}: {refused:?}");
        assert!(refused.stderr.contains("'--no-cache' cannot be used with '--cache <DIR>'"), "{args:?}: {refused:?}");
    }
}
