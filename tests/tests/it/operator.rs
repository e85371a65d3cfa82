//! What an operator of `snapctl serve` sees: the catalog through the Go oras CLI,
//! htpasswd changes taken on SIGHUP, the request log (JSON), the web view in Chromium.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use snapctl_tests::registry_support::{htpasswd, Serve};

const ORAS: &str = "/opt/snapctl-oras/oras";

/// The Go oras CLI, or `None` (after a loud skip) when it is not installed.
fn oras() -> Option<Command> {
    if !Path::new(ORAS).exists() {
        assert!(!snapctl_tests::require_peers(), "the Go oras CLI ({ORAS}) is required: scripts/install-trixie.sh oras");
        eprintln!("SKIP: {ORAS} not installed");
        return None;
    }
    let mut c = Command::new(ORAS);
    c.env("HOME", std::env::temp_dir());
    Some(c)
}

/// A repository laid out on disk as an earlier snapctl stored it (a manifest link only):
/// the server indexes it into its catalog when it starts.
fn lay_out_repository(root: &Path, name: &str) {
    let hex = snapctl_tests::registry_support::sha256(name.as_bytes());
    let dir = root.join(format!("repositories/{name}/_manifests/sha256"));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(hex.trim_start_matches("sha256:")), "application/vnd.oci.image.manifest.v1+json").unwrap();
}

fn status(url: &str, user: &str, pw: &str) -> u16 {
    reqwest::blocking::Client::new().get(url).basic_auth(user, Some(pw)).send().unwrap().status().as_u16()
}

/// `oras repo ls` walks the catalog page by page (150 repositories: more than the default
/// page of 100) and `oras repo tags` lists a repository's tags.
#[test]
fn regression_issue_25_oras_repo_ls_and_repo_tags() {
    let Some(_) = oras() else { return };
    let storage = tempfile::tempdir().unwrap();
    let mut names: Vec<String> = (0..150).map(|i| format!("old/r{i:03}")).collect();
    for n in &names {
        lay_out_repository(storage.path(), n);
    }
    let s = Serve::start(storage.path().to_str().unwrap(), &[], &[]);
    let work = tempfile::tempdir().unwrap();
    std::fs::write(work.path().join("note.txt"), b"hello").unwrap();
    for (repo, tag) in [("team/app", "v1"), ("team/app", "v2"), ("team-b", "latest")] {
        let out = oras()
            .unwrap()
            .current_dir(work.path())
            .args(["push", "--plain-http", "--no-tty", &format!("{}/{repo}:{tag}", s.addr), "note.txt"])
            .output()
            .unwrap();
        assert!(out.status.success(), "oras push: {}\n{}", String::from_utf8_lossy(&out.stderr), s.log_text());
    }
    names.extend(["team/app".to_owned(), "team-b".to_owned()]);
    names.sort_by_key(|a| a.replace('/', "\0"));
    let out = oras().unwrap().args(["repo", "ls", "--plain-http", &s.addr]).output().unwrap();
    assert!(out.status.success(), "oras repo ls: {}\n{}", String::from_utf8_lossy(&out.stderr), s.log_text());
    let listed: Vec<String> = String::from_utf8_lossy(&out.stdout).lines().map(str::to_owned).collect();
    assert_eq!(listed, names, "oras repo ls");
    // 152 repositories, pages of 100: oras must have followed the Link header once.
    assert_eq!(s.log_text().matches("path=\"/v2/_catalog\" status=200").count(), 2, "oras did not page: {}", s.log_text());
    let out = oras().unwrap().args(["repo", "ls", "--plain-http", &format!("{}/team", s.addr)]).output().unwrap();
    assert!(out.status.success(), "oras repo ls NS: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "app", "oras repo ls of a namespace");
    let out = oras().unwrap().args(["repo", "tags", "--plain-http", &format!("{}/team/app", s.addr)]).output().unwrap();
    assert!(out.status.success(), "oras repo tags: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().collect::<Vec<_>>(), ["v1", "v2"]);
}

/// SIGHUP reloads the htpasswd file: the old password is refused, the new one accepted,
/// by the same process.
#[test]
fn regression_issue_25_sighup_reloads_htpasswd() {
    let storage = tempfile::tempdir().unwrap();
    let file = storage.path().join("htpasswd");
    htpasswd(&file, &[("alice", "old")]);
    let mut s = Serve::start(storage.path().join("store").to_str().unwrap(), &["--htpasswd", file.to_str().unwrap(), "--htpasswd-poll", "0"], &[]);
    let url = s.url("/v2/");
    assert_eq!(status(&url, "alice", "old"), 200);
    htpasswd(&file, &[("alice", "new")]);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(status(&url, "alice", "old"), 200, "reloaded without being asked (--htpasswd-poll 0)");
    let pid = s.child.id();
    // SAFETY: kill(2) on our own child's pid; no memory is involved.
    unsafe { libc::kill(pid as i32, libc::SIGHUP) };
    let mut ok = false;
    for _ in 0..100 {
        if status(&url, "alice", "new") == 200 {
            ok = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(ok, "new password refused after SIGHUP: {}", s.log_text());
    assert_eq!(status(&url, "alice", "old"), 401);
    assert!(s.child.try_wait().unwrap().is_none(), "the server exited");
    assert!(s.log_text().contains("htpasswd file reloaded"), "{}", s.log_text());
    assert_eq!(s.terminate().code(), Some(0));
}

/// `--log-format json`: one JSON object per line; a request's line names the client, the
/// user, the user agent, the bytes and the status, and a 500's line its cause.
#[test]
fn regression_issue_25_request_log_in_json_names_who_what_and_why() {
    let storage = tempfile::tempdir().unwrap();
    let file = storage.path().join("htpasswd");
    htpasswd(&file, &[("alice", "pw")]);
    let store = storage.path().join("store");
    let s = Serve::start(store.to_str().unwrap(), &["--htpasswd", file.to_str().unwrap(), "--log-format", "json"], &[]);
    let c = reqwest::blocking::Client::builder().user_agent("ops-test/1.0").build().unwrap();
    let body = b"twelve bytes".to_vec();
    let d = snapctl_tests::registry_support::sha256(&body);
    let r = c.post(s.url(&format!("/v2/r/blobs/uploads/?digest={d}"))).basic_auth("alice", Some("pw")).body(body).send().unwrap();
    assert_eq!(r.status().as_u16(), 201);
    let r = c.get(s.url(&format!("/v2/r/blobs/{d}"))).basic_auth("alice", Some("pw")).send().unwrap();
    assert_eq!(r.bytes().unwrap().len(), 12);
    // A tag whose content is not a digest: the server cannot answer (500) and says why.
    let tag = store.join("repositories/r/_tags/broken");
    std::fs::create_dir_all(tag.parent().unwrap()).unwrap();
    std::fs::write(&tag, b"not a digest").unwrap();
    let r = c.get(s.url("/v2/r/manifests/broken")).basic_auth("alice", Some("pw")).send().unwrap();
    assert_eq!(r.status().as_u16(), 500);
    std::thread::sleep(Duration::from_millis(300));
    let log = s.log_text();
    let lines: Vec<serde_json::Value> =
        log.lines().filter(|l| l.starts_with('{')).map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"))).collect();
    let find = |method: &str, path: &str| {
        lines.iter().find(|v| v["message"] == "request" && v["method"] == method && v["path"].as_str().is_some_and(|p| p.ends_with(path))).cloned()
    };
    let post = find("POST", "/blobs/uploads/").unwrap_or_else(|| panic!("no log line for the POST: {log}"));
    assert_eq!(post["status"], 201);
    assert_eq!(post["user"], "alice");
    assert_eq!(post["bytes_in"], 12);
    assert_eq!(post["user_agent"], "ops-test/1.0");
    assert!(post["client"].as_str().unwrap().starts_with("127.0.0.1:"), "{post}");
    assert!(post["timestamp"].is_string() && post["ms"].is_u64(), "{post}");
    let get = find("GET", &format!("/blobs/{d}")).unwrap_or_else(|| panic!("no log line for the GET: {log}"));
    assert_eq!((get["status"].as_u64(), get["bytes_out"].as_u64()), (Some(200), Some(12)), "{get}");
    let failed = find("GET", "/manifests/broken").unwrap_or_else(|| panic!("no log line for the 500: {log}"));
    assert_eq!(failed["status"], 500);
    assert_eq!(failed["level"], "ERROR");
    assert!(failed["error"].as_str().is_some_and(|e| e.contains("corrupt")), "the 500's cause is not logged: {failed}");
    assert!(lines.len() >= 3 && log.lines().all(|l| l.trim().is_empty() || l.starts_with('{') || l.starts_with("snapctl serve:")), "{log}");
}

/// Issue 35: the JSON request log wrote the C1 control characters of a User-Agent raw
/// (a JSON writer escapes C0 only): a NEL (U+0085) starts a new line in many log viewers,
/// where the text after it passes for a line of the server's own. Every control character
/// of a logged field is escaped now.
#[test]
fn regression_issue_35_the_json_log_escapes_c1_controls_of_a_user_agent() {
    let storage = tempfile::tempdir().unwrap();
    let s = Serve::start(storage.path().join("store").to_str().unwrap(), &["--log-format", "json"], &[]);
    let ua = reqwest::header::HeaderValue::from_bytes(b"evil/1.0\xc2\x85{\"message\":\"request\"}\xc2\x9b31m").unwrap();
    let r = reqwest::blocking::Client::new().get(s.url("/v2/")).header("user-agent", ua).send().unwrap();
    assert_eq!(r.status().as_u16(), 200);
    std::thread::sleep(Duration::from_millis(300));
    let log = s.log_text();
    assert!(!log.chars().any(|c| ('\u{80}'..='\u{9f}').contains(&c)), "a C1 control reached the log raw: {log:?}");
    let line: serde_json::Value = log
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["path"] == "/v2/")
        .unwrap_or_else(|| panic!("no log line for the request: {log}"));
    assert_eq!(line["user_agent"], "evil/1.0\\u{85}{\"message\":\"request\"}\\u{9b}31m", "{line}");
}

const CHROMIUM: &str = "/usr/bin/chromium";

/// Headless Chromium: the DOM of `url` after loading it.
fn chromium_dom(url: &str) -> String {
    let profile = tempfile::tempdir().unwrap();
    let out = Command::new(CHROMIUM)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--timeout=20000",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(["--dump-dom", url])
        .output()
        .expect("run chromium");
    assert!(out.status.success(), "chromium {url}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The `href`s of the `<a>` elements of a DOM.
fn links(dom: &str) -> Vec<String> {
    dom.split("<a ")
        .skip(1)
        .filter_map(|a| a.split_once("href=\""))
        .filter_map(|(_, rest)| rest.split_once('"'))
        .map(|(h, _)| h.replace("&amp;", "&"))
        .collect()
}

/// The statuses the server logged for requests Chromium made to `path`.
fn chromium_statuses(log: &str, path: &str) -> Vec<u64> {
    log.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["message"] == "request" && v["path"] == path && v["user_agent"].as_str().is_some_and(|u| u.contains("HeadlessChrome")))
        .filter_map(|v| v["status"].as_u64())
        .collect()
}

/// The web view in a real browser: every page reachable from the index loads (200, as
/// the server logged Chromium's requests) and shows what is stored; without credentials
/// Chromium gets the API's 401 and no page names a repository.
#[test]
fn regression_issue_25_web_view_in_headless_chromium() {
    if !Path::new(CHROMIUM).exists() {
        assert!(!snapctl_tests::require_peers(), "{CHROMIUM} is required: scripts/setup.sh --tests");
        eprintln!("SKIP: {CHROMIUM} not installed");
        return;
    }
    let work = tempfile::tempdir().unwrap();
    let store = work.path().join("store");
    let snap = work.path().join("snap");
    let run = |args: &[&str]| {
        let r = snapctl_tests::run(snapctl_tests::snapctl().args(args));
        assert_eq!(r.code, 0, "snapctl {args:?}: {}", r.stderr);
    };
    // Content first, on an open server: a snapshot, a layer over it, a referrer.
    {
        let s = Serve::start(store.to_str().unwrap(), &[], &[]);
        run(&["sample", snap.to_str().unwrap(), "--size", "2MiB"]);
        run(&["push", snap.to_str().unwrap(), &format!("{}/snaps/vm:v1", s.addr)]);
        run(&["sample", snap.to_str().unwrap(), "--size", "2MiB", "--mutate", "3"]);
        run(&["push", snap.to_str().unwrap(), &format!("{}/snaps/vm:v2", s.addr), "--parent", &format!("{}/snaps/vm:v1", s.addr)]);
        if let Some(mut o) = oras() {
            std::fs::write(work.path().join("sig.txt"), b"signed").unwrap();
            let out = o
                .current_dir(work.path())
                .args([
                    "attach",
                    "--plain-http",
                    "--no-tty",
                    "--artifact-type",
                    "application/vnd.example.signature",
                    &format!("{}/snaps/vm:v1", s.addr),
                    "sig.txt",
                ])
                .output()
                .unwrap();
            assert!(out.status.success(), "oras attach: {}", String::from_utf8_lossy(&out.stderr));
        }
    }
    let file = work.path().join("htpasswd");
    htpasswd(&file, &[("alice", "pw")]);
    let s = Serve::start(store.to_str().unwrap(), &["--htpasswd", file.to_str().unwrap(), "--log-format", "json"], &[]);
    let base = format!("http://alice:pw@{}", s.addr);
    // The totals come from the scan at start.
    let mut pages = vec!["/ui/".to_owned()];
    let mut seen = std::collections::HashSet::new();
    let mut doms = String::new();
    while let Some(p) = pages.pop() {
        if !seen.insert(p.clone()) || seen.len() > 40 {
            continue;
        }
        let dom = chromium_dom(&format!("{base}{p}"));
        assert!(dom.contains("snapctl registry"), "{p} did not render: {dom}");
        for l in links(&dom) {
            assert!(l.starts_with('/'), "{p}: link {l} leaves the view");
            pages.push(l);
        }
        doms.push_str(&dom);
    }
    std::thread::sleep(Duration::from_millis(300));
    let log = s.log_text();
    for p in &seen {
        let path = p.split('?').next().unwrap();
        let st = chromium_statuses(&log, path);
        // Chromium asks without credentials first and answers the 401 with the URL's.
        assert!(st.last() == Some(&200) && st.iter().all(|s| *s == 200 || *s == 401), "{p}: Chromium got {st:?}\n{log}");
    }
    assert!(seen.len() >= 5, "only {} pages reached: {seen:?}", seen.len());
    for want in ["snaps/vm", "v1", "v2", "dedup ratio", "chain depth", "<th>kind</th><td>firecracker</td>", "logical bytes", "stored bytes"] {
        assert!(doms.contains(want), "no page shows {want:?}");
    }
    if oras().is_some() {
        assert!(doms.contains("application/vnd.example.signature"), "the referrer is not shown");
    }
    // Without credentials: the API's challenge, and nothing stored named.
    let api = reqwest::blocking::get(s.url("/v2/")).unwrap();
    let challenge = api.headers()["www-authenticate"].to_str().unwrap().to_owned();
    for p in ["/ui/", "/ui/repo/snaps/vm", "/ui/repo/nothing/here"] {
        let r = reqwest::blocking::get(s.url(p)).unwrap();
        assert_eq!(r.status().as_u16(), 401, "{p}");
        let got: Vec<&str> = r.headers().get_all("www-authenticate").iter().map(|v| v.to_str().unwrap()).collect();
        assert_eq!(got.first().copied(), Some(challenge.as_str()), "{p}: not the API's challenge");
        let dom = chromium_dom(&s.url(p));
        assert!(!dom.contains("snaps") && !dom.contains("vm") && !dom.contains("nothing"), "{p} leaks a name: {dom}");
    }
    let log = s.log_text();
    assert!(chromium_statuses(&log, "/ui/").contains(&401), "{log}");
}

/// A gauge's value in a Prometheus text scrape.
fn gauge(metrics: &str, series: &str) -> Option<u64> {
    metrics.lines().find_map(|l| l.strip_prefix(series).and_then(|v| v.strip_prefix(' ')).and_then(|v| v.trim().parse::<f64>().ok())).map(|v| v as u64)
}

fn scrape(s: &Serve) -> String {
    reqwest::blocking::get(s.url("/metrics")).unwrap().text().unwrap()
}

/// `/metrics` once `series` is in it (the scan at start is done).
fn scrape_once(s: &Serve, series: &str) -> String {
    for _ in 0..200 {
        let m = scrape(s);
        if m.contains(series) {
            return m;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("no {series} in /metrics: {}", s.log_text());
}

/// Issue 39: the web view was wrong or silent where operators look. The retention page
/// said "0 B" for every deletion (its dry run had no sweep) and wrote "delete manifest"
/// lines into the server's log; a cosign `.sig` tag was an ordinary tag typed as an image
/// config, a signed image said "Referrers None", no signer anywhere; no bytes per
/// repository; the store gauges stood still for up to 5 minutes after a push. Each seen
/// in headless Chromium and in `/metrics`.
#[test]
fn regression_issue_39_web_view_shows_true_bytes_signatures_and_repository_sizes() {
    if !Path::new(CHROMIUM).exists() {
        assert!(!snapctl_tests::require_peers(), "{CHROMIUM} is required: scripts/setup.sh --tests");
        eprintln!("SKIP: {CHROMIUM} not installed");
        return;
    }
    let work = tempfile::tempdir().unwrap();
    let (store, cfg) = (work.path().join("store"), work.path().join("serve.toml"));
    let p = |name: &str| work.path().join(name).to_string_lossy().into_owned();
    let sn = |args: &[&str]| {
        let r = snapctl_tests::run(
            snapctl_tests::snapctl()
                .args(args)
                .env("COSIGN_PASSWORD", "pw")
                .env("HOME", work.path())
                .env("SNAPCTL_CACHE", work.path().join("cache"))
                .env("DOCKER_CONFIG", work.path().join("docker")),
        );
        assert_eq!(r.code, 0, "snapctl {args:?}: {}", r.stderr);
        r.stdout
    };
    // The server's own gc schedule (not due during the test) with no delay: a re-pushed
    // tag's old image would go now.
    std::fs::write(&cfg, "[gc]\ninterval = \"24h\"\ngrace = \"0s\"\n[retention]\ndelay = \"0s\"\n").unwrap();
    sn(&["key", "generate", "--output-key-prefix", &p("cosign")]);
    let fingerprint = sn(&["key", "fingerprint", &p("cosign.pub")]).trim().to_owned();
    let (old, current) = (p("a"), p("b"));
    sn(&["sample", &old, "--size", "4MiB", "--seed", "1"]);
    sn(&["sample", &current, "--size", "4MiB", "--seed", "2"]);
    let latest = {
        let mut s = Serve::start(store.to_str().unwrap(), &["--config", cfg.to_str().unwrap()], &[]);
        let before = scrape_once(&s, "snapctl_store_scan_timestamp_seconds ");
        let old_d = sn(&["push", &old, &format!("{}/vm:latest", s.addr)]).trim().to_owned();
        let latest = sn(&["push", &current, &format!("{}/vm:latest", s.addr)]).trim().to_owned();
        sn(&["push", &current, &format!("{}/other/vm:v1", s.addr)]);
        sn(&["sign", &format!("{}/vm:latest", s.addr), "--key", &p("cosign.key")]);
        assert_ne!(old_d, latest);
        // The gauges follow the pushes at once (the next scan is minutes away).
        let after = scrape(&s);
        let g = |m: &str, k: &str| gauge(m, k).unwrap_or_else(|| panic!("no {k}: {m}"));
        assert_eq!(g(&after, "snapctl_store_scan_timestamp_seconds"), g(&before, "snapctl_store_scan_timestamp_seconds"), "a scan ran: {after}");
        assert!(g(&after, "snapctl_store_bytes") > g(&before, "snapctl_store_bytes") + (1 << 20), "{after}");
        assert_eq!(g(&after, "snapctl_store_repositories"), 2, "{after}");
        assert!(g(&after, "snapctl_store_manifests") >= g(&before, "snapctl_store_manifests") + 4, "two images, one of them twice, a signature: {after}");
        assert!(s.terminate().success(), "{}", s.log_text());
        latest
    };
    // What `gc --dry-run` says the re-pushed tag's old image frees.
    std::thread::sleep(Duration::from_millis(50));
    let dry: serde_json::Value =
        serde_json::from_str(&sn(&["gc", "--storage", store.to_str().unwrap(), "--config", cfg.to_str().unwrap(), "--dry-run", "--json"])).unwrap();
    let going: Vec<&serde_json::Value> = dry["retention"]["manifests"].as_array().unwrap().iter().filter(|v| v["action"] == "delete").collect();
    assert_eq!(going.len(), 1, "{dry}");
    let bytes = going[0]["bytes"].as_u64().unwrap();
    assert!(bytes > 1 << 20, "{dry}");
    let s = Serve::start(store.to_str().unwrap(), &["--config", cfg.to_str().unwrap(), "--trusted-key", &p("cosign.pub"), "--log-format", "json"], &[]);
    let metrics = scrape_once(&s, "snapctl_repository_bytes{");
    let repo = |r: &str, kind: &str| {
        gauge(&metrics, &format!("snapctl_repository_bytes{{repository=\"{r}\",kind=\"{kind}\"}}")).unwrap_or_else(|| panic!("{r} {kind}: {metrics}"))
    };
    assert!(repo("vm", "own") > 1 << 20, "the old image is vm's own: {metrics}");
    assert!(repo("vm", "shared") > 1 << 20 && repo("other/vm", "shared") == repo("vm", "shared"), "the current image is in both: {metrics}");
    let base = format!("http://{}", s.addr);
    let retention = chromium_dom(&format!("{base}/ui/retention"));
    let want = imgfmt::size::human(bytes);
    // The deletion's row: its bytes, then its shared bytes (none: nothing else goes).
    assert!(
        retention.contains(&format!("<td class=\"num\">{want}</td><td class=\"num\">0 B</td>")),
        "the page does not show gc --dry-run's {want}: {retention}"
    );
    let index = chromium_dom(&format!("{base}/ui/"));
    assert!(index.contains("own bytes") && index.contains(&format!(">{}<", imgfmt::size::human(repo("vm", "own")))), "{index}");
    let tags = chromium_dom(&format!("{base}/ui/repo/vm"));
    assert!(tags.contains("signature (cosign) of"), "the .sig tag is not a signature: {tags}");
    let image = chromium_dom(&format!("{base}/ui/repo/vm/_manifest/{latest}"));
    let signatures = image.split("<h2>Signatures</h2>").nth(1).unwrap_or_else(|| panic!("no Signatures section: {image}"));
    assert!(signatures.contains(&fingerprint) && signatures.contains(">yes<"), "not verified by the trusted key {fingerprint}: {image}");
    std::thread::sleep(Duration::from_millis(300));
    let log = s.log_text();
    assert!(!log.contains("delete manifest") && !log.contains("sweep blob"), "reading the page wrote verdicts to the log: {log}");
}
