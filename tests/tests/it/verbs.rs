//! The verbs users kept skopeo or oras for (issue 39): `tag`, `ls`, `delete`, and
//! `serve --check-config`, against `snapctl serve`, an OCI layout and docker-registry; and
//! the rough edges met on the way (a missing repository, a new store's log, short help).

use std::process::Command;

use snapctl_tests::registry_support::{layout_manifest_digest, Distribution};
use snapctl_tests::{run, Run, Work};

const PASSWORD: &str = "issue-39";

/// A work area that is also the commands' home and working directory, its commands
/// having the cosign key's password.
fn work() -> Work {
    Work::new().at_home().with_env("COSIGN_PASSWORD", PASSWORD)
}

/// Steps of these tests beside [`Work`]'s own.
trait VerbsWork {
    /// A sample snapshot of 1 MiB in `dir` (seeded by `seed`).
    fn seeded(&self, dir: &str, seed: u64);
    /// `snapctl push DIR REF [--parent P]`: the manifest digest.
    fn push(&self, dir: &str, reference: &str, parent: Option<&str>) -> String;
}

impl VerbsWork for Work {
    fn seeded(&self, dir: &str, seed: u64) {
        self.sample_with(dir, "1MiB", &["--seed", &seed.to_string()]);
    }
    fn push(&self, dir: &str, reference: &str, parent: Option<&str>) -> String {
        let mut args = vec!["push", &self.s(dir), reference, "--json", "--chunk-size", "64KiB"].into_iter().map(str::to_string).collect::<Vec<_>>();
        if let Some(p) = parent {
            args.extend(["--parent".to_string(), p.to_string()]);
        }
        let r = self.ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
        let v: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
        v["manifest"].as_str().unwrap().to_string()
    }
}

fn json(r: &Run) -> serde_json::Value {
    serde_json::from_str(&r.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {r:?}"))
}

/// The digest a registry serves for `repo:reference`, `None` on 404.
fn registry_digest(addr: &str, repo: &str, reference: &str) -> Option<String> {
    let r = reqwest::blocking::Client::new()
        .get(format!("http://{addr}/v2/{repo}/manifests/{reference}"))
        .header("accept", "application/vnd.oci.image.manifest.v1+json")
        .send()
        .unwrap();
    (r.status() == 200).then(|| r.headers()["docker-content-digest"].to_str().unwrap().to_string())
}

#[test]
fn regression_issue_39_tag_names_the_same_manifest_and_moves_no_blob() {
    let w = work();
    let serve = w.serve("store", &[]);
    w.seeded("snap", 1);
    let v1 = w.push("snap", &format!("{}/vm/base:v1", serve.addr), None);
    let blobs_before = serve.log_text().matches("/blobs/").count();
    let r = w.ok(&["tag", &format!("{}/vm/base:v1", serve.addr), "stable"]);
    assert_eq!(r.stdout.trim(), v1);
    assert_eq!(registry_digest(&serve.addr, "vm/base", "stable").as_deref(), Some(v1.as_str()));
    let log = serve.log_text();
    assert_eq!(log.matches("/blobs/").count(), blobs_before, "tag read or wrote a blob: {log}");

    // A layout: the same, by digest too.
    let l = w.path("l");
    w.ok(&["copy", &format!("{}/vm/base:v1", serve.addr), &format!("oci:{}:v1", l.display())]);
    let r = w.ok(&["tag", &format!("oci:{}@{v1}", l.display()), "golden"]);
    assert_eq!(r.stdout.trim(), v1);
    assert_eq!(layout_manifest_digest(&l, "golden").as_deref(), Some(v1.as_str()));
    // A bad tag is refused before anything is read.
    let r = w.run(&["tag", &format!("oci:{}:v1", l.display()), "bad/tag"]);
    assert_eq!(r.code, 2, "{r:?}");
}

#[test]
fn regression_issue_39_ls_lists_repositories_and_tags_with_what_they_name() {
    let w = work();
    let serve = w.serve("store", &[]);
    w.seeded("snap", 1);
    let v1 = w.push("snap", &format!("{}/vm/a:v1", serve.addr), None);
    w.push("snap", &format!("{}/vm/b:v1", serve.addr), None);
    w.ok(&["key", "generate", "--output-key-prefix", &w.s("k")]);
    w.ok(&["sign", &format!("{}/vm/a@{v1}", serve.addr), "--key", &w.s("k.key")]);
    w.ok(&["tag", &format!("{}/vm/a:v1", serve.addr), "v2"]);

    let r = w.ok(&["ls", &serve.addr]);
    assert_eq!(r.stdout.lines().collect::<Vec<_>>(), ["vm/a", "vm/b"], "{r:?}");
    let v = json(&w.ok(&["ls", &serve.addr, "--json"]));
    assert_eq!(v["repositories"], serde_json::json!(["vm/a", "vm/b"]));

    let v = json(&w.ok(&["ls", &format!("{}/vm/a", serve.addr), "--json"]));
    let tags = v["tags"].as_array().unwrap();
    assert_eq!(tags.iter().map(|t| t["tag"].as_str().unwrap()).collect::<Vec<_>>(), ["v1", "v2"], "the .sig tag is left out: {v}");
    for t in tags {
        assert_eq!(t["digest"], v1.as_str());
        assert!(t["size"].as_u64().unwrap() > 0, "{t}");
        assert_eq!(t["signed"], true, "{t}");
        assert!(t["created"].is_string(), "{t}");
    }
    let all = json(&w.ok(&["ls", &format!("{}/vm/a", serve.addr), "--json", "--all"]));
    assert_eq!(all["tags"].as_array().unwrap().len(), 3, "{all}");
    let unsigned = json(&w.ok(&["ls", &format!("{}/vm/b", serve.addr), "--json"]));
    assert_eq!(unsigned["tags"][0]["signed"], false, "{unsigned}");
    let text = w.ok(&["ls", &format!("{}/vm/a", serve.addr)]).stdout;
    assert!(text.lines().next().unwrap().starts_with("TAG"), "{text}");
    assert!(text.contains(&v1) && text.contains("yes"), "{text}");

    // A layout, and docker-registry (no referrers API: the .sig tag says signed).
    let l = w.path("l");
    w.ok(&["copy", &format!("{}/vm/a:v1", serve.addr), &format!("oci:{}:v1", l.display())]);
    let v = json(&w.ok(&["ls", &format!("oci:{}", l.display()), "--json"]));
    assert_eq!(v["tags"][0]["tag"], "v1");
    assert_eq!(v["tags"][0]["signed"], true, "copy carried the signature: {v}");
    let dist = Distribution::start(&w.path("dist"));
    w.ok(&["copy", &format!("{}/vm/a:v1", serve.addr), &format!("{}/mirror/a:v1", dist.addr)]);
    assert_eq!(w.ok(&["ls", &dist.addr]).stdout.trim(), "mirror/a");
    let v = json(&w.ok(&["ls", &format!("{}/mirror/a", dist.addr), "--json"]));
    assert_eq!((v["tags"][0]["digest"].as_str(), v["tags"][0]["signed"].as_bool()), (Some(v1.as_str()), Some(true)), "{v}");
    // A repository that does not exist.
    let r = w.run(&["ls", &format!("{}/vm/nope", serve.addr)]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("repository vm/nope does not exist"), "{r:?}");
}

#[test]
fn regression_issue_39_delete_a_tag_or_a_manifest_not_a_parent_unless_forced() {
    let w = work();
    let serve = w.serve("store", &[]);
    w.seeded("snap", 1);
    let repo = format!("{}/vm/chain", serve.addr);
    let base = w.push("snap", &format!("{repo}:v1"), None);
    std::fs::write(w.path("snap").join("extra"), b"a change").unwrap();
    let layer = w.push("snap", &format!("{repo}:v2"), Some(&format!("{repo}:v1")));
    assert_ne!(base, layer);

    // Without its tag the base is still kept by the layer: deleting the tag is fine.
    w.ok(&["tag", &format!("{repo}:v1"), "old"]);
    w.ok(&["delete", &format!("{repo}:old")]);
    assert_eq!(registry_digest(&serve.addr, "vm/chain", "old"), None);
    assert_eq!(registry_digest(&serve.addr, "vm/chain", "v1").as_deref(), Some(base.as_str()));

    let r = w.run(&["delete", &format!("{repo}@{base}")]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("v2 has it as its parent") && r.stderr.contains("--force"), "{r:?}");
    assert_eq!(registry_digest(&serve.addr, "vm/chain", &base).as_deref(), Some(base.as_str()), "refused, so kept");
    // No tag or digest named: refused, not `latest` guessed.
    assert_eq!(w.run(&["delete", &repo]).code, 2);
    w.ok(&["delete", &format!("{repo}@{base}"), "--force"]);
    assert_eq!(registry_digest(&serve.addr, "vm/chain", &base), None);
    assert_eq!(registry_digest(&serve.addr, "vm/chain", "v1"), None, "its tags went with it");
    w.ok(&["delete", &format!("{repo}@{layer}")]);
    assert_eq!(w.run(&["delete", &format!("{repo}@{layer}")]).code, 2, "gone already");

    // A layout: the same refusal, then the manifest and its tags go.
    let l = w.path("l");
    w.seeded("snap2", 2);
    let lref = |s: &str| format!("oci:{}{s}", l.display());
    w.ok(&["pack", &w.s("snap2"), &lref(":v1")]);
    std::fs::write(w.path("snap2").join("extra"), b"a change").unwrap();
    w.ok(&["pack", &w.s("snap2"), &lref(":v2"), "--parent", &lref(":v1")]);
    let lbase = layout_manifest_digest(&l, "v1").unwrap();
    let r = w.run(&["delete", &lref(&format!("@{lbase}"))]);
    assert!(r.code == 2 && r.stderr.contains("v2 has it as its parent"), "{r:?}");
    w.ok(&["delete", &lref(":v2")]);
    assert_eq!(layout_manifest_digest(&l, "v2"), None);
    w.ok(&["delete", &lref(&format!("@{lbase}"))]);
    assert_eq!(layout_manifest_digest(&l, "v1"), None);
}

#[test]
fn regression_issue_39_delete_says_when_a_registry_refuses_deletes() {
    let w = work();
    let serve = w.serve("store", &[]);
    w.seeded("snap", 1);
    let d = w.push("snap", &format!("{}/vm/x:v1", serve.addr), None);
    let refusing = Distribution::start_without_delete(&w.path("nodel"));
    w.ok(&["copy", &format!("{}/vm/x:v1", serve.addr), &format!("{}/vm/x:v1", refusing.addr)]);
    let r = w.run(&["delete", &format!("{}/vm/x@{d}", refusing.addr)]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("does not allow deleting") && r.stderr.contains("storage.delete.enabled"), "{r:?}");

    let deleting = Distribution::start(&w.path("del"));
    w.ok(&["copy", &format!("{}/vm/x:v1", serve.addr), &format!("{}/vm/x:v1", deleting.addr)]);
    w.ok(&["delete", &format!("{}/vm/x@{d}", deleting.addr)]);
    assert_eq!(registry_digest(&deleting.addr, "vm/x", &d), None);
}

#[test]
fn regression_issue_39_serve_check_config_prints_the_settings_or_the_error() {
    let w = work();
    let good = w.path("good.toml");
    std::fs::write(&good, "listen = \"127.0.0.1:1\"\nupload_ttl = \"1h\"\n[gc]\ninterval = \"12h\"\n").unwrap();
    let r = w.run(&["serve", "--check-config", good.to_str().unwrap()]);
    assert_eq!(r.code, 0, "{r:?}");
    for line in ["listen = \"127.0.0.1:1\"", "upload_ttl = \"1h\"", "interval = \"12h\"", "header_timeout = \"30s\""] {
        assert!(r.stdout.lines().any(|l| l == line), "{line:?} missing: {}", r.stdout);
    }
    // Flags are laid over the file, as serve lays them.
    let r = w.run(&["serve", "--check-config", good.to_str().unwrap(), "--upload-ttl", "5m"]);
    assert!(r.stdout.lines().any(|l| l == "upload_ttl = \"5m\""), "{r:?}");

    for (name, text, says) in [
        ("bad-duration.toml", "upload_ttl = \"soon\"\n", "upload_ttl"),
        ("needs-htpasswd.toml", "acl = \"acl.toml\"\n", "htpasswd"),
        ("unknown-key.toml", "listne = \"x\"\n", "listne"),
        ("missing-htpasswd.toml", "htpasswd = \"/nonexistent/htpasswd\"\n", "/nonexistent/htpasswd"),
    ] {
        let p = w.path(name);
        std::fs::write(&p, text).unwrap();
        let r = w.run(&["serve", "--check-config", p.to_str().unwrap()]);
        assert_eq!(r.code, 2, "{name}: {r:?}");
        assert!(r.stdout.is_empty() && r.stderr.contains(says), "{name}: {r:?}");
    }
}

#[test]
fn regression_issue_39_a_missing_repository_is_not_a_missing_tag() {
    let w = work();
    let serve = w.serve("store", &[]);
    w.seeded("snap", 1);
    w.push("snap", &format!("{}/vm/here:v1", serve.addr), None);
    let r = w.run(&["inspect", &format!("{}/vm/gone:v1", serve.addr)]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("repository vm/gone does not exist") && r.stderr.contains("NAME_UNKNOWN"), "{r:?}");
    let r = w.run(&["inspect", &format!("{}/vm/here:v9", serve.addr)]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("tag \"v9\" not found"), "{r:?}");
    // distribution says the same two things the same way.
    let dist = Distribution::start(&w.path("dist"));
    let r = w.run(&["pull", &format!("{}/vm/gone:v1", dist.addr), &w.s("out")]);
    assert!(r.code == 2 && r.stderr.contains("repository vm/gone does not exist"), "{r:?}");
}

#[test]
fn regression_issue_39_a_new_store_does_not_log_an_old_stores_indexing() {
    let w = work();
    let serve = w.serve("fresh", &[]);
    let c = reqwest::blocking::get(serve.url("/v2/_catalog")).unwrap();
    assert_eq!(c.status(), 200);
    // The indexing runs at start; a second request after it has had its turn.
    std::thread::sleep(std::time::Duration::from_millis(200));
    reqwest::blocking::get(serve.url("/v2/")).unwrap();
    let log = serve.log_text();
    assert!(!log.contains("before the catalog existed"), "{log}");
}

#[test]
fn regression_issue_39_short_help_is_short() {
    let w = work();
    for cmd in ["push", "pull", "copy", "serve", "lazy"] {
        let short = w.ok(&[cmd, "-h"]).stdout;
        let long = w.ok(&[cmd, "--help"]).stdout;
        // Each flag's entry: its line and the lines continuing it, up to the next flag.
        let options = short.split_once("Options:").map_or("", |(_, o)| o);
        let mut entries: Vec<(String, usize)> = Vec::new();
        for line in options.lines().filter(|l| !l.trim().is_empty()) {
            match entries.last_mut() {
                Some((_, n)) if !line.trim_start().starts_with('-') => *n += 1,
                _ => entries.push((line.trim().to_string(), 1)),
            }
        }
        assert!(entries.len() > 5, "{cmd} -h: {short}");
        for (flag, n) in &entries {
            assert!(*n <= 4, "{cmd} -h: {n} lines for {flag}\n{short}");
        }
        assert!(long.lines().count() > short.lines().count(), "{cmd} --help says more than -h");
    }
}

/// `(position, total)` of every frame of a byte bar (`12.50 MiB/32.00 MiB`) in `text`.
fn bar_frames(text: &str) -> Vec<(f64, f64)> {
    let bytes = |num: &str, unit: &str| -> Option<f64> {
        let n: f64 = num.parse().ok()?;
        let m = match unit.trim_end_matches(|c: char| !c.is_ascii_alphabetic()) {
            "B" => 1.0,
            "KiB" => 1024.0,
            "MiB" => 1048576.0,
            "GiB" => 1073741824.0,
            _ => return None,
        };
        Some(n * m)
    };
    let words: Vec<&str> = text.split(|c: char| c.is_whitespace() || c == ']').filter(|w| !w.is_empty()).collect();
    let mut frames = Vec::new();
    for i in 1..words.len().saturating_sub(1) {
        // "12.50", "MiB/32.00", "MiB"
        let Some((unit, total)) = words[i].split_once('/') else { continue };
        if let (Some(p), Some(t)) = (bytes(words[i - 1], unit), bytes(total, words[i + 1])) {
            frames.push((p, t));
        }
    }
    frames
}

#[test]
fn regression_issue_39_pull_progress_counts_data_to_fetch_not_zeros() {
    use snapctl_tests::netem::{Netem, NetemConfig};
    let w = work();
    let serve = w.serve("store", &[]);
    w.ok(&["sample", &w.s("snap"), "--size", "64MiB", "--zero-fraction", "0.5"]);
    w.push("snap", &format!("{}/vm/p:v1", serve.addr), None);
    let net = Netem::start(serve.addr.as_str(), NetemConfig::new(std::time::Duration::from_millis(2)).rate(200_000_000)).unwrap();
    let host = net.addr.clone();
    // stderr on a terminal (script(1)'s), so the bar is drawn.
    let bin = snapctl_tests::snapctl_bin();
    let line = format!("{} pull {host}/vm/p:v1 {} --no-cache", bin.display(), w.s("out"));
    let ts = w.path("typescript");
    let r = run(Command::new("script")
        .args(["-q", "-e", "-c", &line, ts.to_str().unwrap()])
        .env("SNAPCTL_CACHE", w.path("cache"))
        .env("DOCKER_CONFIG", w.path("docker"))
        .env("COLUMNS", "120")
        .env_remove("SNAPCTL_LOG"));
    assert_eq!(r.code, 0, "{r:?}");
    let text = String::from_utf8_lossy(&std::fs::read(&ts).unwrap()).into_owned();
    let frames = bar_frames(&text);
    assert!(!frames.is_empty(), "no bar drawn: {text:?}");
    let image = 64.0 * 1048576.0;
    for (p, t) in &frames {
        assert!(*t < 0.75 * image, "the bar counts to {t} bytes of a 64 MiB image half zeros: {text:?}");
        assert!(p <= t);
    }
    assert!(frames[0].0 < frames[0].1 / 2.0, "the bar started at {:?}: {text:?}", frames[0]);
}

#[test]
fn regression_issue_39_man_pages_have_environment_and_files() {
    let w = work();
    let man = w.ok(&["man"]).stdout;
    for want in [".SH ENVIRONMENT", ".SH FILES", "SNAPCTL_CACHE", "DOCKER_CONFIG", "config.json"] {
        assert!(man.contains(want), "{want} missing");
    }
}

#[test]
fn regression_issue_39_gc_logs_one_set_of_keys() {
    let w = work();
    let serve = w.serve("store", &[]);
    w.seeded("snap", 1);
    w.push("snap", &format!("{}/vm/g:v1", serve.addr), None);
    w.ok(&["delete", &format!("{}/vm/g:v1", serve.addr)]);
    let r = run(w.cmd().args(["gc", "--storage", &w.s("store"), "--grace", "0", "--dry-run"]).env("SNAPCTL_LOG", "debug"));
    assert_eq!(r.code, 0, "{r:?}");
    let lines: Vec<&str> = r.stderr.lines().filter(|l| l.contains("delete manifest") || l.contains("sweep blob")).collect();
    assert!(!lines.is_empty(), "{r:?}");
    for l in lines {
        assert!(l.contains("digest=") && !l.contains(" d=") && !l.contains(" r=") && !l.contains(" t="), "{l}");
    }
}
