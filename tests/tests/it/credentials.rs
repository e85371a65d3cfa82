//! Credentials as docker keeps them (issue 13 §2): `credsStore` / `credHelpers` name a
//! `docker-credential-NAME` program, and `identitytoken`s are refresh tokens for the token
//! flow. A fake helper (a shell script on PATH, keeping its secrets in a directory) stands
//! in for Docker Desktop's keychain, against `snapctl serve --htpasswd`.

use std::fs;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use snapctl_tests::registry_support::{htpasswd, Serve};
use snapctl_tests::{run, snapctl, Run};

/// `docker-credential-snapctltest`: one file per server in $SNAPCTL_TEST_CREDS, holding
/// what `store` was given; every call is appended to `calls` there.
const FAKE_HELPER: &str = r#"#!/bin/sh
set -eu
dir="$SNAPCTL_TEST_CREDS"
input=$(cat)
key() { printf %s "$1" | tr -c 'A-Za-z0-9.' _; }
case "$1" in
  get)
    echo "get $input" >> "$dir/calls"
    if [ -f "$dir/$(key "$input")" ]; then cat "$dir/$(key "$input")"; else echo "credentials not found in native keychain"; exit 1; fi ;;
  store)
    server=$(printf %s "$input" | sed -n 's/.*"ServerURL":"\([^"]*\)".*/\1/p')
    echo "store $server" >> "$dir/calls"
    printf %s "$input" > "$dir/$(key "$server")" ;;
  erase)
    echo "erase $input" >> "$dir/calls"
    if [ -f "$dir/$(key "$input")" ]; then rm "$dir/$(key "$input")"; else echo "credentials not found in native keychain"; exit 1; fi ;;
  *) echo "unknown action $1"; exit 1 ;;
esac
"#;

/// `docker-credential-snapctlbroken`: a keychain that cannot be opened.
const BROKEN_HELPER: &str = "#!/bin/sh\ncat >/dev/null\necho 'the keychain is locked'\nexit 1\n";

const USER: &str = "alice";
const PASSWORD: &str = "s3cret-pw";

/// A registry that wants a password, and a machine with its own Docker config, PATH (the
/// fake helpers first) and helper storage.
struct Setup {
    dir: tempfile::TempDir,
    serve: Serve,
    /// `oci:` reference of a small packed image.
    image: String,
}

impl Setup {
    fn new(serve_extra: &[&str]) -> Setup {
        let dir = tempfile::tempdir().unwrap();
        let p = |s: &str| dir.path().join(s);
        for d in ["bin", "creds", "docker", "storage"] {
            fs::create_dir_all(p(d)).unwrap();
        }
        for (name, text) in [("docker-credential-snapctltest", FAKE_HELPER), ("docker-credential-snapctlbroken", BROKEN_HELPER)] {
            fs::write(p("bin").join(name), text).unwrap();
            fs::set_permissions(p("bin").join(name), fs::Permissions::from_mode(0o755)).unwrap();
        }
        htpasswd(&p("htpasswd"), &[(USER, PASSWORD)]);
        let ht = p("htpasswd");
        let mut args = vec!["--htpasswd", ht.to_str().unwrap()];
        args.extend_from_slice(serve_extra);
        let serve = Serve::start(p("storage").to_str().unwrap(), &args, &[]);
        let snap = p("snap");
        let r = run(snapctl().arg("sample").arg(&snap).args(["--size", "1MiB"]));
        assert_eq!(r.code, 0, "{r:?}");
        let image = format!("oci:{}:v1", p("layout").display());
        let r = run(snapctl().arg("pack").arg(&snap).arg(&image));
        assert_eq!(r.code, 0, "{r:?}");
        Setup { dir, serve, image }
    }
    fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }
    fn host(&self) -> &str {
        &self.serve.addr
    }
    fn config(&self, json: &str) {
        fs::write(self.path("docker/config.json"), json).unwrap();
    }
    fn config_text(&self) -> String {
        fs::read_to_string(self.path("docker/config.json")).unwrap_or_default()
    }
    /// Seed the fake helper's keychain.
    fn helper_has(&self, username: &str, secret: &str) {
        let key: String = self.host().chars().map(|c| if c.is_ascii_alphanumeric() || c == '.' { c } else { '_' }).collect();
        let j = serde_json::json!({"ServerURL": self.host(), "Username": username, "Secret": secret});
        fs::write(self.path("creds").join(key), j.to_string()).unwrap();
    }
    fn helper_calls(&self) -> String {
        fs::read_to_string(self.path("creds/calls")).unwrap_or_default()
    }
    /// snapctl with this machine's HOME, Docker config, cache and PATH.
    fn cmd(&self) -> Command {
        let mut c = snapctl();
        let path = format!("{}:{}", self.path("bin").display(), std::env::var("PATH").unwrap_or_default());
        c.env("PATH", path)
            .env("HOME", self.dir.path())
            .env("DOCKER_CONFIG", self.path("docker"))
            .env("SNAPCTL_CACHE", self.path("cache"))
            .env("SNAPCTL_TEST_CREDS", self.path("creds"));
        c
    }
    fn snapctl(&self, args: &[&str]) -> Run {
        run(self.cmd().args(args))
    }
    fn login(&self, password: &str) -> Run {
        let mut c = self.cmd();
        c.args(["login", self.host(), "-u", USER, "--password-stdin"]).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = c.spawn().unwrap();
        child.stdin.take().unwrap().write_all(format!("{password}\n").as_bytes()).unwrap();
        let out = child.wait_with_output().unwrap();
        Run {
            code: out.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }
    fn remote(&self, repo: &str) -> String {
        format!("{}/{repo}:v1", self.host())
    }
}

fn ok(r: &Run, what: &str) {
    assert_eq!(r.code, 0, "{what}: {r:?}");
}

/// Issue 13: with `credsStore` (Docker Desktop's default), snapctl said "run snapctl login".
/// It now asks the helper, with the host on stdin, and pushes and pulls with its answer; a
/// per-host `credHelpers` entry wins over `credsStore`.
#[test]
fn regression_issue_13_credentials_from_a_docker_credential_helper() {
    let s = Setup::new(&[]);
    s.helper_has(USER, PASSWORD);
    s.config(r#"{"credsStore":"snapctltest"}"#);
    let remote = s.remote("vm/helper");
    ok(&s.snapctl(&["push", &s.image, &remote]), "push with the helper's credentials");
    ok(&s.snapctl(&["pull", &remote, s.path("out").to_str().unwrap()]), "pull with the helper's credentials");
    assert!(s.helper_calls().contains(&format!("get {}", s.host())), "the helper was asked for the host: {}", s.helper_calls());

    // credHelpers[host] is used; the credsStore named beside it (not installed) never runs.
    s.config(&format!(r#"{{"credsStore":"snapctl-not-installed","credHelpers":{{"{}":"snapctltest"}}}}"#, s.host()));
    ok(&s.snapctl(&["inspect", &remote]), "inspect through credHelpers");

    // The helper has nothing for the host: anonymous, and the registry's refusal says how
    // to log in.
    fs::remove_file(s.path("creds").join(s.host().replace(':', "_"))).unwrap();
    let r = s.snapctl(&["inspect", &remote]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("snapctl login"), "{}", r.stderr);

    // A helper that fails otherwise is a clear error naming it; one not installed too.
    s.config(r#"{"credsStore":"snapctlbroken"}"#);
    let r = s.snapctl(&["inspect", &remote]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("docker-credential-snapctlbroken get failed") && r.stderr.contains("the keychain is locked"), "{}", r.stderr);
    s.config(r#"{"credsStore":"snapctl-not-installed"}"#);
    let r = s.snapctl(&["inspect", &remote]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("cannot run docker-credential-snapctl-not-installed (credsStore in"), "{}", r.stderr);
}

/// The helper is asked only when a registry wants credentials: a broken keychain does not
/// fail a registry that serves anonymously.
#[test]
fn a_broken_helper_does_not_matter_to_an_anonymous_registry() {
    let dir = tempfile::tempdir().unwrap();
    let s = Serve::start(dir.path().join("storage").to_str().unwrap(), &[], &[]);
    let setup_dir = tempfile::tempdir().unwrap();
    let bin = setup_dir.path().join("bin");
    fs::create_dir_all(&bin).unwrap();
    fs::write(bin.join("docker-credential-snapctlbroken"), BROKEN_HELPER).unwrap();
    fs::set_permissions(bin.join("docker-credential-snapctlbroken"), fs::Permissions::from_mode(0o755)).unwrap();
    fs::create_dir_all(setup_dir.path().join("docker")).unwrap();
    fs::write(setup_dir.path().join("docker/config.json"), r#"{"credsStore":"snapctlbroken"}"#).unwrap();
    let snap = setup_dir.path().join("snap");
    ok(&run(snapctl().arg("sample").arg(&snap).args(["--size", "1MiB"])), "sample");
    let mut c = snapctl();
    c.env("PATH", format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default()))
        .env("DOCKER_CONFIG", setup_dir.path().join("docker"))
        .env("SNAPCTL_CACHE", setup_dir.path().join("cache"))
        .arg("push")
        .arg(&snap)
        .arg(format!("{}/vm/anon:v1", s.addr));
    ok(&run(&mut c), "push to an anonymous registry with a broken credsStore");
}

/// Issue 13: `login` wrote a plaintext password beside a credential store. With one
/// configured it now stores through the helper (`store`, JSON on stdin), leaves no secret
/// in config.json (also none an earlier login left), and `logout` erases it there.
#[test]
fn regression_issue_13_login_stores_through_the_credential_helper() {
    let s = Setup::new(&[]);
    let old = base64_of(&format!("{USER}:old-password"));
    s.config(&format!(r#"{{"credsStore":"snapctltest","auths":{{"{}":{{"auth":"{old}"}},"other.io":{{"auth":"eDp5"}}}}}}"#, s.host()));
    let r = s.login("wrong");
    assert_eq!(r.code, 2, "{r:?}");
    assert!(!s.helper_calls().contains("store"), "nothing stored for a refused login");
    let r = s.login(PASSWORD);
    ok(&r, "login");
    assert!(r.stderr.contains("docker-credential-snapctltest"), "says where the credentials went: {}", r.stderr);
    assert!(!r.stderr.contains("unencrypted"), "{}", r.stderr);
    assert!(s.helper_calls().contains(&format!("store {}", s.host())), "{}", s.helper_calls());
    let stored: serde_json::Value = serde_json::from_str(&fs::read_to_string(s.path("creds").join(s.host().replace(':', "_"))).unwrap()).unwrap();
    assert_eq!(stored, serde_json::json!({"ServerURL": s.host(), "Username": USER, "Secret": PASSWORD}));
    let cfg = s.config_text();
    assert!(!cfg.contains(PASSWORD) && !cfg.contains(&base64_of(&format!("{USER}:{PASSWORD}"))), "no password in config.json: {cfg}");
    let v: serde_json::Value = serde_json::from_str(&cfg).unwrap();
    assert_eq!(v["auths"][s.host()], serde_json::json!({}), "an empty entry, as docker leaves (and the old secret gone)");
    assert_eq!(v["auths"]["other.io"]["auth"], "eDp5", "other entries kept");
    assert_eq!(v["credsStore"], "snapctltest");

    ok(&s.snapctl(&["push", &s.image, &s.remote("vm/login")]), "push after login");
    ok(&s.snapctl(&["logout", s.host()]), "logout");
    assert!(s.helper_calls().contains(&format!("erase {}", s.host())), "{}", s.helper_calls());
    let r = s.snapctl(&["push", &s.image, &s.remote("vm/login2")]);
    assert_eq!(r.code, 2, "logged out: {r:?}");
    assert!(!s.config_text().contains(s.host()), "{}", s.config_text());
}

/// Without a credential store, login still writes config.json, and says the password is
/// not encrypted there.
#[test]
fn login_without_a_store_warns_that_the_file_holds_the_password() {
    let s = Setup::new(&[]);
    s.config(r#"{"credsStore":""}"#);
    let r = s.login(PASSWORD);
    ok(&r, "login");
    assert!(r.stderr.contains("unencrypted"), "{}", r.stderr);
    assert!(s.config_text().contains(&base64_of(&format!("{USER}:{PASSWORD}"))));
}

fn base64_of(s: &str) -> String {
    // Tiny standard base64 (the test crate has no base64 dependency).
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let b = s.as_bytes();
    let mut out = String::new();
    for c in b.chunks(3) {
        let n = (c[0] as u32) << 16 | (*c.get(1).unwrap_or(&0) as u32) << 8 | *c.get(2).unwrap_or(&0) as u32;
        for i in 0..4 {
            out.push(if i <= c.len() { T[(n >> (18 - 6 * i) & 63) as usize] as char } else { '=' });
        }
    }
    out
}

/// A request the realm saw: its method and its decoded form fields.
type Seen = (String, Vec<(String, String)>);

/// A token realm that answers only the OAuth2 refresh-token grant (`POST`,
/// grant_type=refresh_token) for one identity token, minting tokens `snapctl serve`
/// accepts (same signing secret); it records each request's method and form.
struct RefreshRealm {
    url: String,
    seen: Arc<Mutex<Vec<Seen>>>,
    stop: Arc<AtomicBool>,
}

impl RefreshRealm {
    fn start(secret: Vec<u8>, htpasswd_text: String, identity_token: &'static str) -> RefreshRealm {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.set_nonblocking(true).unwrap();
        let url = format!("http://{}/token", l.local_addr().unwrap());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (seen2, stop2) = (seen.clone(), stop.clone());
        let auth = registry::auth::Auth::new(&htpasswd_text, None, false, secret).unwrap();
        std::thread::spawn(move || {
            while !stop2.load(Ordering::Relaxed) {
                match l.accept() {
                    Ok((conn, _)) => {
                        conn.set_nonblocking(false).unwrap();
                        conn.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                        let (method, form) = read_request(&conn);
                        seen2.lock().unwrap().push((method.clone(), form.clone()));
                        let get = |k: &str| form.iter().find(|(x, _)| x == k).map(|(_, v)| v.clone());
                        let granted = method == "POST"
                            && get("grant_type").as_deref() == Some("refresh_token")
                            && get("refresh_token").as_deref() == Some(identity_token);
                        let reply = if granted {
                            let scopes: Vec<String> = get("scope").unwrap_or_default().split(' ').map(str::to_string).collect();
                            let (token, _) = auth.issue_token(Some(USER), &scopes);
                            let body = serde_json::json!({"access_token": token, "expires_in": 300}).to_string();
                            format!("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len())
                        } else {
                            "HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".to_string()
                        };
                        let _ = (&conn).write_all(reply.as_bytes());
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        });
        RefreshRealm { url, seen, stop }
    }
}

impl Drop for RefreshRealm {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// An HTTP/1.1 request's method and its form (query and `application/x-www-form-urlencoded`
/// body, decoded).
fn read_request(conn: &TcpStream) -> Seen {
    let mut r = BufReader::new(conn);
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or_default().to_string();
    let target = parts.next().unwrap_or_default().to_string();
    let mut len = 0usize;
    loop {
        let mut h = String::new();
        r.read_line(&mut h).unwrap();
        if h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            if k.eq_ignore_ascii_case("content-length") {
                len = v.trim().parse().unwrap();
            }
        }
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).unwrap();
    let query = target.split_once('?').map(|(_, q)| q.as_bytes().to_vec()).unwrap_or_default();
    let form = form_urlencoded::parse(&query).chain(form_urlencoded::parse(&body)).map(|(k, v)| (k.into_owned(), v.into_owned())).collect();
    (method, form)
}

/// Issue 13: an `identitytoken` (in `auths`, or from a helper as user `<token>`) is a
/// refresh token: snapctl trades it at the realm with the OAuth2 refresh_token grant (POST,
/// as docker does) and pulls and pushes with the token it gets.
#[test]
fn regression_issue_13_identity_tokens_use_the_refresh_token_grant() {
    const ID_TOKEN: &str = "identity-token-1234";
    let pre = tempfile::tempdir().unwrap();
    let secret_file = pre.path().join("secret");
    let secret = b"0123456789abcdef0123456789abcdef-shared".to_vec();
    fs::write(&secret_file, &secret).unwrap();
    // The realm needs the server's users only to build an `Auth`; it grants by token.
    htpasswd(&pre.path().join("h"), &[(USER, PASSWORD)]);
    let realm = RefreshRealm::start(secret, fs::read_to_string(pre.path().join("h")).unwrap(), ID_TOKEN);
    let s = Setup::new(&["--token-secret-file", secret_file.to_str().unwrap(), "--token-realm", &realm.url]);

    // From auths.identitytoken.
    s.config(&format!(r#"{{"auths":{{"{}":{{"identitytoken":"{ID_TOKEN}"}}}}}}"#, s.host()));
    let remote = s.remote("vm/idtoken");
    ok(&s.snapctl(&["push", &s.image, &remote]), "push with an identity token from auths");
    ok(&s.snapctl(&["verify", &remote]), "verify with an identity token from auths");
    {
        let seen = realm.seen.lock().unwrap();
        assert!(!seen.is_empty());
        for (method, form) in seen.iter() {
            assert_eq!(method, "POST", "{form:?}");
            let has = |k: &str, v: &str| form.iter().any(|(x, y)| x == k && y == v);
            assert!(has("grant_type", "refresh_token") && has("refresh_token", ID_TOKEN) && has("service", "snapctl"), "{form:?}");
        }
        assert!(seen.iter().any(|(_, f)| f.iter().any(|(k, v)| k == "scope" && v.contains("repository:vm/idtoken:pull,push"))), "{seen:?}");
    }

    // From a credential helper, as user "<token>".
    s.helper_has("<token>", ID_TOKEN);
    s.config(r#"{"credsStore":"snapctltest"}"#);
    let before = realm.seen.lock().unwrap().len();
    ok(&s.snapctl(&["pull", &remote, s.path("out").to_str().unwrap()]), "pull with an identity token from a helper");
    assert!(realm.seen.lock().unwrap().len() > before);

    // A wrong identity token is refused by the realm: exit 2 with its answer.
    s.config(&format!(r#"{{"auths":{{"{}":{{"identitytoken":"wrong"}}}}}}"#, s.host()));
    let r = s.snapctl(&["inspect", &remote]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("401"), "{}", r.stderr);
}
