//! What snapctl keeps on a host and sends from it, over months of hibernations (issue 22
//! §2, §3): a re-push takes the tag's image as its parent by itself and sends only what
//! changed; everything kept under the cache directory (chunks, push layouts, upload
//! state) counts against one budget, is evicted least-recently-used, survives a kill in
//! the middle of an eviction, and `snapctl cache` shows and prunes it.

use std::fs;
use std::path::{Path, PathBuf};

use snapctl_tests::fault_proxy::FaultProxy;
use snapctl_tests::registry_support::Serve;
use snapctl_tests::{run, snapctl, Run, Work};

const MIB: u64 = 1 << 20;

/// Steps of these tests beside [`Work`]'s own.
trait HostWork {
    /// A sample snapshot of `size` with no holes (every block is data).
    fn dense_sample(&self, name: &str, size: &str) -> PathBuf;
    /// Rewrite one 1 MiB block of `dir` in place (another one for every `seed`).
    fn mutate(&self, dir: &Path, size: &str, seed: u32);
}

impl HostWork for Work {
    fn dense_sample(&self, name: &str, size: &str) -> PathBuf {
        self.sample_with(name, size, &["--zero-fraction", "0"])
    }
    fn mutate(&self, dir: &Path, size: &str, seed: u32) {
        self.ok(&["sample", dir.to_str().unwrap(), "--size", size, "--zero-fraction", "0", "--mutate", "1", "--seed", &seed.to_string()]);
    }
}

/// The JSON `r` printed on stdout.
fn json(r: &Run) -> serde_json::Value {
    serde_json::from_str(&r.stdout).unwrap_or_else(|e| panic!("no JSON on stdout ({e}): {r:?}"))
}

/// Issue 22 §3: `push DIR HOST/REPO:TAG` where TAG already holds a snapctl image of the
/// same files takes it as the parent by itself (and says so), so three re-pushes of a
/// 24 MiB directory in which one 1 MiB block changed each send about 1 MiB each, counted
/// at a proxy in front of the registry (before: the whole image, every time); and
/// `--no-parent` pushes a full image again.
#[test]
fn regression_issue_22_repushes_send_only_changed_chunks() {
    let storage = tempfile::tempdir().unwrap();
    let serve = Serve::start(storage.path().to_str().unwrap(), &[], &[]);
    let proxy = FaultProxy::start(serve.addr.as_str()).unwrap();
    let w = Work::new();
    let size = "24MiB";
    let snap = w.dense_sample("snap", size);
    let dest = format!("{}/vm/sandbox:latest", proxy.addr);

    let first = w.ok(&["push", snap.to_str().unwrap(), &dest, "--json"]);
    assert!(!first.stderr.contains("as the parent"), "nothing to build on yet: {}", first.stderr);
    let mut last = json(&first)["manifest"].as_str().unwrap().to_string();
    for round in 1..=3u32 {
        w.mutate(&snap, size, round);
        let before = proxy.bytes_up();
        let r = w.ok(&["push", snap.to_str().unwrap(), &dest, "--json"]);
        let sent = proxy.bytes_up() - before;
        let rep = json(&r);
        assert!(sent < 2 * MIB, "round {round}: one changed 1 MiB chunk (and metadata) should go up, {sent} bytes went: {rep}");
        assert!(r.stderr.contains(&format!("{dest} as the parent")) && r.stderr.contains(&last), "round {round}: stderr names the parent: {}", r.stderr);
        assert_eq!(rep["pack"]["chain_depth"], round as u64, "round {round}: a layer over the tag's image: {rep}");
        last = rep["manifest"].as_str().unwrap().to_string();
    }
    // What the tag holds now pulls as the directory is.
    let out = w.path("out");
    w.ok(&["pull", &dest, out.to_str().unwrap()]);
    assert!(fs::read(out.join("vm.mem")).unwrap() == fs::read(snap.join("vm.mem")).unwrap(), "the pulled layer differs from the directory");

    // --no-parent: a full image, all of it sent again (the registry has none of its packs:
    // the chain's are laid out differently).
    w.mutate(&snap, size, 9);
    let r = w.ok(&["push", snap.to_str().unwrap(), &dest, "--json", "--no-parent"]);
    assert!(!r.stderr.contains("as the parent"), "{}", r.stderr);
    assert_eq!(json(&r)["pack"]["chain_depth"], 0);
}

/// Issue 22 §3, `pack`: packing into a layout tag that already holds an image of the same
/// files makes a layer over it; files of other names, or `--no-parent`, make a full image.
#[test]
fn regression_issue_22_pack_into_an_existing_tag_makes_a_layer() {
    let w = Work::new();
    let size = "8MiB";
    let snap = w.dense_sample("snap", size);
    let dest = format!("oci:{}:vm", w.path("layout").display());
    let first = json(&w.ok(&["pack", snap.to_str().unwrap(), &dest, "--json"]));
    assert_eq!(first["chain_depth"], 0);
    w.mutate(&snap, size, 1);
    let r = w.ok(&["pack", snap.to_str().unwrap(), &dest, "--json"]);
    assert!(r.stderr.contains("as the parent"), "{}", r.stderr);
    let second = json(&r);
    assert_eq!(second["chain_depth"], 1, "{second}");
    assert_eq!(second["stored_chunks"], 1, "only the changed chunk is stored: {second}");
    w.ok(&["verify", &dest]);

    // Another set of files under the same tag: not the same snapshot, a full image.
    fs::write(snap.join("extra.img"), b"a file the tag's image does not have").unwrap();
    let r = w.ok(&["pack", snap.to_str().unwrap(), &dest, "--json"]);
    assert!(r.stderr.contains("not the same files") && r.stderr.contains("extra.img"), "{}", r.stderr);
    assert_eq!(json(&r)["chain_depth"], 0);
    fs::remove_file(snap.join("extra.img")).unwrap();
    let r = w.ok(&["pack", snap.to_str().unwrap(), &dest, "--json", "--no-parent"]);
    assert_eq!(json(&r)["chain_depth"], 0);
}

/// Allocated bytes of everything under `dir` (what the budget bounds).
fn du(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(names) = fs::read_dir(&d) else { continue };
        for e in names.flatten() {
            let md = fs::symlink_metadata(e.path()).unwrap();
            total += md.blocks() * 512;
            if md.is_dir() {
                stack.push(e.path());
            }
        }
    }
    total
}

/// Issue 22 §2: push keeps only what resuming and the next layer need. Three pushes of a
/// 24 MiB directory (one block changed before each) leave its push layout holding
/// metadata only, not the packs the registry now has (before: 39 -> 78 -> 119 MB for a
/// 38 MiB image, never pruned); and the next push still makes a layer from it.
#[test]
fn regression_issue_22_push_layouts_keep_only_metadata() {
    let storage = tempfile::tempdir().unwrap();
    let serve = Serve::start(storage.path().to_str().unwrap(), &[], &[]);
    let w = Work::new();
    let size = "24MiB";
    let snap = w.dense_sample("snap", size);
    let dest = format!("{}/vm/keep:latest", serve.addr);
    for round in 0..3u32 {
        if round > 0 {
            w.mutate(&snap, size, round);
        }
        w.ok(&["push", snap.to_str().unwrap(), &dest]);
        let held = du(&w.cache().join("push-layouts"));
        assert!(held < MIB, "after push {round}: the push layouts hold {held} bytes; the packs are in the registry");
    }
    let r = json(&w.ok(&["push", snap.to_str().unwrap(), &dest, "--json", "--chunk-size", "1MiB"]));
    assert_eq!(r["bytes_sent"], 0, "unchanged: nothing to send: {r}");
}

/// Issue 22 §2: one budget for everything under the cache directory. With
/// `SNAPCTL_CACHE_SIZE=12MiB`, alternating pushes of an 8 MiB directory and pulls of it
/// with `--cache-copy` leave at most 12 MiB there after every command (before: chunks
/// were bounded, push layouts and the rest were not counted).
#[test]
fn regression_issue_22_pushes_and_pulls_stay_within_the_budget() {
    let storage = tempfile::tempdir().unwrap();
    let serve = Serve::start(storage.path().to_str().unwrap(), &[], &[]);
    let w = Work::new();
    let size = "8MiB";
    let budget = 12 * MIB;
    let snap = w.dense_sample("snap", size);
    for round in 0..4u32 {
        w.mutate(&snap, size, round + 1);
        let dest = format!("{}/vm/budget{}:latest", serve.addr, round % 2);
        let push = run(w.cmd().env("SNAPCTL_CACHE_SIZE", budget.to_string()).args(["push", snap.to_str().unwrap(), &dest]));
        assert_eq!(push.code, 0, "{push:?}");
        let held = du(&w.cache());
        assert!(held <= budget, "after push {round}: {held} bytes under the cache directory, budget {budget}");
        let out = w.path(&format!("out{round}"));
        let pull = run(w.cmd().env("SNAPCTL_CACHE_SIZE", budget.to_string()).args(["pull", &dest, out.to_str().unwrap(), "--cache-copy"]));
        assert_eq!(pull.code, 0, "{pull:?}");
        let held = du(&w.cache());
        assert!(held <= budget, "after pull {round}: {held} bytes under the cache directory, budget {budget}");
    }
    let usage = json(&w.ok(&["cache", "--json", "--cache-size", &budget.to_string()]));
    assert_eq!(usage["limit_bytes"], budget, "{usage}");
    assert!(usage["total_bytes"].as_u64().unwrap() <= budget, "{usage}");
    let kinds: Vec<&str> = usage["kinds"].as_array().unwrap().iter().map(|k| k["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["chunks", "push-layouts", "uploads", "known-blobs"]);
}

/// Issue 22: `snapctl cache` listed a kind `traces` that was always empty: nothing puts a
/// trace under the cache directory (lazy stores each trace beside its image). It lists
/// the kinds the cache directory holds, and its help says where traces are.
#[test]
fn regression_issue_22_cache_lists_no_kind_nothing_fills() {
    let w = Work::new();
    let usage = json(&w.ok(&["cache", "--json"]));
    let kinds: Vec<&str> = usage["kinds"].as_array().unwrap().iter().map(|k| k["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["chunks", "push-layouts", "uploads", "known-blobs"], "{usage}");
    let text = w.ok(&["cache"]).stdout;
    assert!(!text.lines().any(|l| l.starts_with("traces")), "{text}");
    let help = w.ok(&["cache", "--help"]).stdout;
    assert!(help.contains("traces are not kept here"), "{help}");
}

/// Issue 22 §2: an eviction killed half-way leaves a consistent cache. A prune is killed
/// (-9) once it has moved the push layout aside and before it deleted it: the layout is
/// gone from its name (never half there), `snapctl cache` still reads the directory, the
/// next prune removes the leftover, and push and pull work as before.
#[test]
fn regression_issue_22_a_killed_eviction_leaves_a_consistent_cache() {
    let storage = tempfile::tempdir().unwrap();
    let serve = Serve::start(storage.path().to_str().unwrap(), &[], &[]);
    let w = Work::new();
    let size = "4MiB";
    let snap = w.dense_sample("snap", size);
    let dest = format!("{}/vm/crash:latest", serve.addr);
    w.ok(&["push", snap.to_str().unwrap(), &dest]);
    w.ok(&["pull", &dest, w.path("out").to_str().unwrap(), "--cache-copy"]);
    let layouts = w.cache().join("push-layouts");
    let layout = fs::read_dir(&layouts).unwrap().flatten().map(|e| e.path()).find(|p| p.is_dir()).expect("a push layout");
    // The push layout is the oldest entry: the prune starts with it.
    let old = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
    // (Its recency is the latest of its lock's, its stamp's and its index.json's mtimes.)
    for p in fs::read_dir(&layouts).unwrap().flatten().map(|e| e.path()).filter(|p| p.is_file()).chain([layout.join("index.json")]) {
        fs::File::options().write(true).open(p).unwrap().set_modified(old).unwrap();
    }
    let mut child = w
        .cmd()
        .env("SNAPCTL_EVICT_DELAY_MS", "3000")
        .args(["cache", "prune", "--all"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let moved = loop {
        if let Some(p) =
            fs::read_dir(&layouts).unwrap().flatten().map(|e| e.path()).find(|p| p.file_name().unwrap().to_string_lossy().starts_with(".evicting-"))
        {
            break p;
        }
        assert!(std::time::Instant::now() < deadline, "the prune never moved the layout aside");
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(!layout.exists(), "the layout is either whole under its name or gone from it");
    assert!(moved.exists(), "killed before deleting it");
    // The next command that opens the cache runs a pass, which removes the leftover
    // (holding the pass lock, so no other pass is deleting it).
    let usage = json(&w.ok(&["cache", "--json"]));
    assert_eq!(usage["kinds"][1]["entries"], 0, "no push layout is listed: {usage}");
    assert!(!moved.exists(), "the leftover of the killed eviction is removed by the next pass");
    assert!(fs::read_dir(&layouts).unwrap().flatten().all(|e| !e.file_name().to_string_lossy().starts_with(".evicting-")));
    assert!(usage["kinds"][0]["entries"].as_u64().unwrap() > 0, "the chunks the prune had not reached are still there: {usage}");
    // Everything works as before: a push (packed again) and a pull (fetched again).
    w.mutate(&snap, size, 5);
    w.ok(&["push", snap.to_str().unwrap(), &dest]);
    let out = w.path("out2");
    w.ok(&["pull", &dest, out.to_str().unwrap()]);
    assert!(fs::read(out.join("vm.mem")).unwrap() == fs::read(snap.join("vm.mem")).unwrap());
}

/// Issue 35 §6: `snapctl cache prune --all` run over and over beside pushes. A push writes
/// its stamp and its upload state under the cache directory through temp files renamed
/// into place; the prune took those temp files for entries and deleted them, so pushes
/// failed after packing (`push-layouts/<key>.stamp.json: No such file or directory`) or
/// lost their resume state (`cannot save upload state`). Files being written by a live
/// process are not entries: every push succeeds and says nothing of its state.
#[test]
fn regression_issue_35_pushes_beside_prunes_all_succeed() {
    let storage = tempfile::tempdir().unwrap();
    let serve = Serve::start(storage.path().to_str().unwrap(), &[], &[]);
    let w = Work::new();
    let size = "2MiB";
    let dirs: Vec<PathBuf> = (0..5).map(|i| w.dense_sample(&format!("snap{i}"), size)).collect();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let pruner = {
        let (done, cache, docker) = (done.clone(), w.cache(), w.path("docker"));
        std::thread::spawn(move || {
            let mut prunes = 0u32;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let r = run(snapctl().env("SNAPCTL_CACHE", &cache).env("DOCKER_CONFIG", &docker).args(["cache", "prune", "--all"]));
                assert_eq!(r.code, 0, "prune: {r:?}");
                prunes += 1;
            }
            prunes
        })
    };
    let mut failed = Vec::new();
    let mut said = Vec::new();
    for round in 0..5u32 {
        let pushes: Vec<_> = dirs
            .iter()
            .enumerate()
            .map(|(i, d)| {
                w.mutate(d, size, round + 1);
                let mut c = w.cmd();
                c.args(["push", d.to_str().unwrap(), &format!("{}/vm/pruned{i}:latest", serve.addr), "--upload-piece", "64KiB"]);
                std::thread::spawn(move || run(&mut c))
            })
            .collect();
        for p in pushes {
            let r = p.join().unwrap();
            if r.code != 0 {
                failed.push(r.stderr.clone());
            } else if r.stderr.contains("cannot save upload state") {
                said.push(r.stderr.clone());
            }
        }
    }
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let prunes = pruner.join().unwrap();
    assert!(prunes >= 5, "the prunes ran beside the pushes: {prunes}");
    assert!(failed.is_empty(), "{} of 25 pushes failed beside prunes: {failed:#?}", failed.len());
    assert!(said.is_empty(), "{} of 25 pushes lost their upload state: {said:#?}", said.len());
}
