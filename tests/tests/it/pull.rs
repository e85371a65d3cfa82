//! `snapctl pull` (issue 4, pull side) against `snapctl serve` and Debian's
//! docker-registry: byte-identical files, the per-host chunk cache (a second pull fetches
//! nothing, a layer after its parent fetches about its changed chunks, a damaged cache
//! entry is caught, the size limit holds), kill -9 and resume, and a tampered pack on the
//! registry side failing with exit 1 and no file left under its final name.
//!
//! Images get into the registries with `skopeo copy --preserve-digests` from a layout
//! packed by `snapctl pack`, so these tests depend on no push code.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use snapctl_tests::registry_support::{Distribution, Serve};
use snapctl_tests::{have, run, snapctl, Run};

const FILES: [&str; 2] = ["vm.mem", "vm.state"];

/// Two snapshots (`v1`, and `v2` = v1 with 3 blocks of vm.mem rewritten, packed as a layer
/// over v1) in a registry repository `sandboxes/vm`, and their source files.
struct Fixture {
    work: tempfile::TempDir,
    repo: String,
    snap1: PathBuf,
    snap2: PathBuf,
}

impl Fixture {
    fn new(registry_addr: &str, size: &str) -> Fixture {
        let work = tempfile::tempdir().unwrap();
        let w = work.path();
        let snap2 = w.join("snap2");
        let snap1 = w.join("snap1");
        ok(&run(snapctl().arg("sample").arg(&snap2).args(["--size", size])));
        fs::create_dir(&snap1).unwrap();
        for f in FILES {
            fs::copy(snap2.join(f), snap1.join(f)).unwrap();
        }
        let lay = w.join("layout");
        let l1 = format!("oci:{}:v1", lay.display());
        ok(&run(snapctl().arg("pack").arg(&snap1).arg(&l1)));
        ok(&run(snapctl().arg("sample").arg(&snap2).args(["--size", size, "--mutate", "3"])));
        ok(&run(snapctl().arg("pack").arg(&snap2).arg(format!("oci:{}:v2", lay.display())).args(["--parent", &l1])));
        let repo = format!("{registry_addr}/sandboxes/vm");
        for tag in ["v1", "v2"] {
            let r = run(Command::new("skopeo").args([
                "copy",
                "--quiet",
                "--preserve-digests",
                "--dest-tls-verify=false",
                &format!("oci:{}:{tag}", lay.display()),
                &format!("docker://{repo}:{tag}"),
            ]));
            assert_eq!(r.code, 0, "skopeo copy {tag}: {r:?}");
        }
        Fixture { work, repo, snap1, snap2 }
    }

    /// A fixture in a fresh `snapctl serve`: its storage directory and the server (kept
    /// alive by the caller), then the fixture.
    fn served(size: &str) -> (tempfile::TempDir, Serve, Fixture) {
        let storage = tempfile::tempdir().unwrap();
        let serve = Serve::start(storage.path().to_str().unwrap(), &[], &[]);
        let fx = Fixture::new(&serve.addr, size);
        (storage, serve, fx)
    }

    fn path(&self, p: &str) -> PathBuf {
        self.work.path().join(p)
    }
}

fn ok(r: &Run) {
    assert_eq!(r.code, 0, "{r:?}");
}

/// `snapctl pull <repo:tag> <dest> --json --cache <cache> <extra>`, its report parsed.
fn pull(image: &str, dest: &Path, cache: Option<&Path>, extra: &[&str]) -> (Run, serde_json::Value) {
    let mut c = snapctl();
    c.args(["pull", image]).arg(dest).arg("--json").args(extra);
    match cache {
        Some(dir) => c.arg("--cache").arg(dir),
        None => c.arg("--no-cache"),
    };
    let r = run(&mut c);
    let j = if r.code == 0 { serde_json::from_str(&r.stdout).unwrap_or_else(|e| panic!("--json output: {e}: {}", r.stdout)) } else { serde_json::Value::Null };
    (r, j)
}

fn n(j: &serde_json::Value, k: &str) -> u64 {
    j[k].as_u64().unwrap_or_else(|| panic!("{k} missing in {j}"))
}

fn assert_same_files(a: &Path, b: &Path) {
    for f in FILES {
        assert!(fs::read(a.join(f)).unwrap() == fs::read(b.join(f)).unwrap(), "{f} differs between {} and {}", a.display(), b.display());
        assert_eq!(fs::metadata(a.join(f)).unwrap().len(), fs::metadata(b.join(f)).unwrap().len());
    }
}

/// Files in `dir` other than hidden temp names (what a reader of the directory would take
/// for a restored file).
fn visible_files(dir: &Path) -> Vec<String> {
    let Ok(rd) = fs::read_dir(dir) else { return vec![] };
    let mut v: Vec<String> = rd.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).filter(|n| !n.starts_with('.')).collect();
    v.sort();
    v
}

/// Cache entries (files under chunks/v1/<algo>/<xx>/: copies, and `.ref` references
/// into pulled files) and their allocated bytes.
fn cache_entries(cache: &Path) -> (Vec<PathBuf>, u64) {
    use std::os::unix::fs::MetadataExt;
    let mut out = Vec::new();
    let mut bytes = 0;
    for algo in ["blake3", "sha256"] {
        let Ok(prefixes) = fs::read_dir(cache.join("chunks/v1").join(algo)) else { continue };
        for p in prefixes.flatten() {
            for e in fs::read_dir(p.path()).unwrap().flatten() {
                bytes += e.metadata().unwrap().blocks() * 512;
                out.push(e.path());
            }
        }
    }
    (out, bytes)
}

/// The whole story against one registry: first pull, second pull (all from the cache),
/// layer after parent (the delta only), no-cache pull, refusal to overwrite.
fn pull_suite(registry_addr: &str) {
    let fx = Fixture::new(registry_addr, "32MiB");
    let cache = fx.path("cache");
    let v1 = format!("{}:v1", fx.repo);
    let v2 = format!("{}:v2", fx.repo);

    let out1 = fx.path("out1");
    let (r, j) = pull(&v1, &out1, Some(&cache), &[]);
    ok(&r);
    assert_same_files(&fx.snap1, &out1);
    let data_chunks = n(&j, "chunks") - n(&j, "zero_chunks");
    assert!(n(&j, "zero_chunks") > 0, "half the sample is holes: {j}");
    assert_eq!(n(&j, "fetched_chunks") + n(&j, "deduplicated_chunks"), data_chunks, "{j}");
    assert_eq!(n(&j, "cached_chunks"), 0, "{j}");
    assert!(n(&j, "bytes_fetched") > 0 && n(&j, "range_requests") > 0, "{j}");
    // Neighbours coalesced: far fewer requests than chunks.
    assert!(n(&j, "range_requests") < n(&j, "fetched_chunks"), "{j}");
    assert!(r.stderr.contains("pulled 2 files"), "{}", r.stderr);
    // Issue 4: cache puts run behind the fetch, in batches; the pull still returns only
    // once every fetched chunk is in the cache.
    assert_eq!(j["cache"]["puts"].as_u64(), Some(n(&j, "fetched_chunks")), "{j}");
    assert_eq!(n(&j, "cache_put_errors"), 0, "{j}");
    assert_eq!(cache_entries(&cache).0.len() as u64, n(&j, "fetched_chunks"), "{j}");
    let full_fetch = n(&j, "bytes_fetched");

    // Same image again, same cache: nothing crosses the network.
    let out1b = fx.path("out1b");
    let (r, j) = pull(&v1, &out1b, Some(&cache), &["--jobs", "2"]);
    ok(&r);
    assert_same_files(&fx.snap1, &out1b);
    assert_eq!((n(&j, "bytes_fetched"), n(&j, "range_requests"), n(&j, "fetched_chunks")), (0, 0, 0), "{j}");
    assert_eq!(n(&j, "cached_chunks") + n(&j, "deduplicated_chunks"), data_chunks, "{j}");

    // The layer after its parent: only the 3 rewritten blocks are fetched.
    let out2 = fx.path("out2");
    let (r, j) = pull(&v2, &out2, Some(&cache), &[]);
    ok(&r);
    assert_same_files(&fx.snap2, &out2);
    let fetched = n(&j, "fetched_chunks");
    assert!((1..=3).contains(&fetched), "a layer with 3 changed blocks fetched {fetched} chunks: {j}");
    assert!(n(&j, "bytes_fetched") <= 3 << 20, "{j}");

    // Without a cache the layer is pulled whole (parent's packs included), still right.
    let out2n = fx.path("out2-nocache");
    let (r, j) = pull(&v2, &out2n, None, &[]);
    ok(&r);
    assert_same_files(&fx.snap2, &out2n);
    assert!(n(&j, "bytes_fetched") >= full_fetch / 2, "{j}");
    assert!(j["cache"].is_null(), "{j}");

    // Existing files are not replaced without --overwrite; with it they are.
    let (r, _) = pull(&v2, &out1, Some(&cache), &[]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains("already exists"), "{}", r.stderr);
    assert_same_files(&fx.snap1, &out1);
    let (r, j) = pull(&v2, &out1, Some(&cache), &["--overwrite"]);
    ok(&r);
    assert_same_files(&fx.snap2, &out1);
    assert_eq!(n(&j, "bytes_fetched"), 0, "{j}");
    assert_eq!(visible_files(&out1), FILES.to_vec());
    assert_eq!(fs::read_dir(&out1).unwrap().count(), 2, "no temp files left behind");

    // By digest too.
    let digest = j["manifest"].as_str().unwrap().to_string();
    let (r, j) = pull(&format!("{}@{digest}", fx.repo), &fx.path("out-digest"), Some(&cache), &[]);
    ok(&r);
    assert_eq!(j["manifest"].as_str().unwrap(), digest);
    assert_same_files(&fx.snap2, &fx.path("out-digest"));

    // Into a layout: the image is copied, digest kept, and verifies there.
    let lay = format!("oci:{}:v2", fx.path("copied").display());
    let r = run(snapctl().args(["pull", &v2, &lay]));
    ok(&r);
    let r = run(snapctl().args(["verify", &lay]));
    ok(&r);
    let r = run(snapctl().args(["inspect", &lay, "--json"]));
    ok(&r);
    let j: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    assert_eq!(j["manifest"].as_str().unwrap(), digest);
}

#[test]
fn pull_from_snapctl_serve() {
    if !have("skopeo") {
        return;
    }
    let storage = tempfile::tempdir().unwrap();
    let serve = Serve::start(storage.path().to_str().unwrap(), &[], &[]);
    pull_suite(&serve.addr);
}

#[test]
fn pull_from_docker_registry() {
    if !have("skopeo") || !have("docker-registry") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let reg = Distribution::start(dir.path());
    pull_suite(&reg.addr);
}

/// A pull killed with -9 half-way leaves no file under its final name, and the rerun
/// fetches only what the first run had not put in the cache.
#[test]
fn pull_killed_then_resumed_fetches_only_the_rest() {
    if !have("skopeo") {
        return;
    }
    let (_storage, _serve, fx) = Fixture::served("32MiB");
    let v1 = format!("{}:v1", fx.repo);
    let cache = fx.path("cache");
    let dest = fx.path("out");
    // One chunk per request, one request at a time, 100 ms apart: slow enough to kill.
    let mut child = snapctl()
        .args(["pull", &v1])
        .arg(&dest)
        .arg("--cache")
        .arg(&cache)
        .args(["--jobs", "1", "--max-range", "1MiB"])
        .env("SNAPCTL_PULL_DELAY_MS", "100")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        // The final names must never show up before the pull is complete.
        assert!(visible_files(&dest).is_empty(), "a final file appeared mid-pull: {:?}", visible_files(&dest));
        if partial_bytes(&dest) >= 4 << 20 {
            break;
        }
        assert!(child.try_wait().unwrap().is_none(), "the throttled pull finished before it could be killed");
        assert!(Instant::now() < deadline, "the pull wrote nothing within 30 s");
        std::thread::sleep(Duration::from_millis(10));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(visible_files(&dest).is_empty(), "killed pull left {:?}", visible_files(&dest));
    let written_before = partial_bytes(&dest);

    let (r, j) = pull(&v1, &dest, Some(&cache), &[]);
    ok(&r);
    assert_same_files(&fx.snap1, &dest);
    assert_eq!(fs::read_dir(&dest).unwrap().count(), 2, "the killed pull's temp files are taken over, none left");
    // Chunks are 1 MiB; the last one written may be torn (not resumed, fetched again).
    assert!(n(&j, "resumed_chunks") + 1 >= written_before >> 20, "{written_before} bytes were written before the kill: {j}");
    let (r, full) = pull(&v1, &fx.path("full"), None, &[]);
    ok(&r);
    assert!(n(&j, "bytes_fetched") < n(&full, "bytes_fetched"), "resume fetched {} of a full {}", j["bytes_fetched"], full["bytes_fetched"]);
    assert_eq!(n(&j, "fetched_chunks") + n(&j, "cached_chunks") + n(&j, "resumed_chunks"), n(&full, "fetched_chunks"), "resume: {j}\nfull: {full}");
}

/// Allocated bytes of the hidden temp files of pulls in `dir`.
fn partial_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(rd) = fs::read_dir(dir) else { return 0 };
    rd.flatten().filter(|e| e.file_name().to_string_lossy().contains(".snapctl-partial")).filter_map(|e| e.metadata().ok()).map(|m| m.blocks() * 512).sum()
}

/// A killed pull's temp file taken over by a pull of ANOTHER image into the same place:
/// whatever the old file holds is checked chunk by chunk, so the result is exactly the
/// new image (no stale byte survives where the new image has zeros or other data).
#[test]
fn regression_issue_4_resume_over_another_images_partial_is_exact() {
    if !have("skopeo") {
        return;
    }
    let (_storage, _serve, fx) = Fixture::served("16MiB");
    let dest = fx.path("out");
    // A "killed pull" of v1: v1's files under temp names of a pid that is not running.
    fs::create_dir_all(&dest).unwrap();
    for f in FILES {
        fs::copy(fx.snap1.join(f), dest.join(format!(".{f}.snapctl-partial-4000000-0-1"))).unwrap();
    }
    // Where v2 has zeros, the old file has data: make sure of it by filling every hole.
    let stale = dest.join(".vm.mem.snapctl-partial-4000000-0-1");
    let mut bytes = fs::read(&stale).unwrap();
    let mut filled = 0;
    for chunk in bytes.chunks_mut(1 << 20).filter(|c| c.iter().all(|&b| b == 0)) {
        chunk.fill(0x5a);
        filled += 1;
    }
    assert!(filled > 0, "the sample has zero chunks");
    fs::write(&stale, &bytes).unwrap();
    let (r, j) = pull(&format!("{}:v2", fx.repo), &dest, None, &[]);
    ok(&r);
    assert_same_files(&fx.snap2, &dest);
    assert!(n(&j, "resumed_chunks") > 0, "v1 and v2 share most chunks: {j}");
    assert_eq!(fs::read_dir(&dest).unwrap().count(), 2, "{:?}", fs::read_dir(&dest).unwrap().collect::<Vec<_>>());
}

/// A flipped byte in a cache entry (a copy, with --cache-copy) is caught by the re-hash on
/// read: the entry is dropped, the chunk fetched again, and the restored file is right.
#[test]
fn damaged_cache_entry_is_refetched_never_written() {
    if !have("skopeo") {
        return;
    }
    let (_storage, _serve, fx) = Fixture::served("16MiB");
    let v1 = format!("{}:v1", fx.repo);
    let cache = fx.path("cache");
    ok(&pull(&v1, &fx.path("a"), Some(&cache), &["--cache-copy"]).0);
    let (entries, _) = cache_entries(&cache);
    assert!(entries.iter().all(|e| e.extension().is_none()), "copies, not references: {entries:?}");
    let victim = &entries[entries.len() / 2];
    let mut bytes = fs::read(victim).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x01;
    fs::write(victim, &bytes).unwrap();

    let (r, j) = pull(&v1, &fx.path("b"), Some(&cache), &[]);
    ok(&r);
    assert_same_files(&fx.snap1, &fx.path("b"));
    assert_eq!(n(&j, "fetched_chunks"), 1, "{j}");
    assert_eq!(j["cache"]["damaged"].as_u64(), Some(1), "{j}");
    // The entry was replaced (by a reference into b, this pull being without --cache-copy).
    let (r, j) = pull(&v1, &fx.path("c"), Some(&cache), &[]);
    ok(&r);
    assert_eq!(n(&j, "bytes_fetched"), 0, "{j}");
}

/// The default cache records references into the pulled files. A pulled file changed
/// afterwards (a byte flipped) makes its reference stale: a miss, the chunk is fetched
/// again, never copied from the changed file; a deleted pull dir likewise.
#[test]
fn regression_issue_4_cache_references_go_stale_safely() {
    if !have("skopeo") {
        return;
    }
    let (_storage, _serve, fx) = Fixture::served("16MiB");
    let v1 = format!("{}:v1", fx.repo);
    let cache = fx.path("cache");
    let (r, j) = pull(&v1, &fx.path("a"), Some(&cache), &[]);
    ok(&r);
    let (entries, _) = cache_entries(&cache);
    assert_eq!(entries.len() as u64, n(&j, "fetched_chunks"));
    assert!(entries.iter().all(|e| e.extension().is_some_and(|x| x == "ref")), "references by default: {entries:?}");

    // Flip one byte of a's vm.mem inside a non-zero chunk.
    let mem = fx.path("a").join("vm.mem");
    let mut bytes = fs::read(&mem).unwrap();
    let at = bytes.iter().rposition(|&b| b != 0).unwrap();
    bytes[at] ^= 0x01;
    fs::write(&mem, &bytes).unwrap();
    let (r, j) = pull(&v1, &fx.path("b"), Some(&cache), &[]);
    ok(&r);
    assert_same_files(&fx.snap1, &fx.path("b"));
    assert_eq!(n(&j, "fetched_chunks"), 1, "{j}");
    assert_eq!(j["cache"]["stale_refs"].as_u64(), Some(1), "{j}");

    // With a and b both gone, every reference is stale: all fetched again, all right.
    fs::remove_dir_all(fx.path("a")).unwrap();
    fs::remove_dir_all(fx.path("b")).unwrap();
    let (r, j2) = pull(&v1, &fx.path("c"), Some(&cache), &[]);
    ok(&r);
    assert_same_files(&fx.snap1, &fx.path("c"));
    assert_eq!(n(&j2, "fetched_chunks"), n(&j, "fetched_chunks") + n(&j, "cached_chunks"), "{j2}");
}

/// A byte flipped in a pack as the registry stores it: exit 1 naming the file and chunk,
/// nothing under a final name, no temp file left, nothing wrong put in the cache.
#[test]
fn tampered_pack_on_the_registry_fails_with_exit_1() {
    if !have("skopeo") {
        return;
    }
    let (storage, _serve, fx) = Fixture::served("16MiB");
    // The v1 pack is the largest blob the registry holds.
    let mut blobs = Vec::new();
    let mut stack = vec![storage.path().to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).unwrap().flatten() {
            let m = e.metadata().unwrap();
            if m.is_dir() {
                stack.push(e.path());
            } else {
                blobs.push((m.len(), e.path()));
            }
        }
    }
    blobs.sort();
    let (len, pack) = blobs.last().unwrap().clone();
    assert!(len > 4 << 20, "expected a pack of several MiB, largest blob is {len} bytes");
    let mut bytes = fs::read(&pack).unwrap();
    bytes[len as usize / 2] ^= 0x80;
    fs::write(&pack, &bytes).unwrap();

    let cache = fx.path("cache");
    let dest = fx.path("out");
    let (r, _) = pull(&format!("{}:v1", fx.repo), &dest, Some(&cache), &[]);
    assert_eq!(r.code, 1, "{r:?}");
    assert!(r.stderr.contains("vm.mem") && r.stderr.contains("chunk"), "message names file and chunk: {}", r.stderr);
    assert!(r.stderr.contains("digest mismatch") || r.stderr.contains("do not decode"), "{}", r.stderr);
    assert_eq!(fs::read_dir(&dest).map(|d| d.count()).unwrap_or(0), 0, "no file and no temp left in {}", dest.display());
    // Whatever made it into the cache hashes to its name (the cache re-checks on read; the
    // pull never puts unverified bytes in).
    for e in cache_entries(&cache).0.into_iter().filter(|e| e.extension().is_none()) {
        let data = fs::read(&e).unwrap();
        assert_eq!(verify::chunk_digest(imgfmt::HashAlgo::Blake3, &data).to_hex(), e.file_name().unwrap().to_str().unwrap());
    }
}

/// Issue 15: a registry that refuses the packs (403) was retried as if it were down
/// (pull retried every `FormatError::Io`, and a refusal was one), and its message did not
/// say how to log in. A refusal is the answer: one request per range in flight, exit 2,
/// a hint naming the registry to `snapctl login` to.
#[test]
fn regression_issue_15_pull_does_not_retry_a_refusal() {
    use snapctl_tests::fault_proxy::{Fault, FaultProxy, Match, Rule};
    if !have("skopeo") {
        return;
    }
    let (_storage, serve, fx) = Fixture::served("8MiB");
    let proxy = FaultProxy::start(serve.addr.as_str()).unwrap();
    // Blob GETs 1 and 2 are config and index; every pack range after them is refused.
    proxy.add(Rule::new(Fault::Status { code: 403 }).on(Match::blob_gets()).nth(3).times(u64::MAX));
    let dest = fx.path("out-refused");
    let (r, _) = pull(&format!("{}/sandboxes/vm:v1", proxy.addr), &dest, None, &["--jobs", "1", "--max-jobs", "1", "--max-range", "1MiB"]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains(&format!("snapctl login {}", proxy.addr)), "says how to log in: {}", r.stderr);
    // Before: the refused range was asked 5 times (4 range retries).
    assert_eq!(proxy.faults(), 1, "a refusal was retried: {}", r.stderr);
}

/// `--cache-size` bounds the cache's allocated bytes; pulls stay right when it churns.
#[test]
fn cache_size_limit_is_honoured() {
    if !have("skopeo") {
        return;
    }
    let (_storage, _serve, fx) = Fixture::served("32MiB");
    let cache = fx.path("cache");
    let (r, j) = pull(&format!("{}:v1", fx.repo), &fx.path("a"), Some(&cache), &["--cache-size", "4MiB", "--cache-copy"]);
    ok(&r);
    assert_same_files(&fx.snap1, &fx.path("a"));
    let (entries, bytes) = cache_entries(&cache);
    assert!(bytes <= 4 << 20, "cache holds {bytes} allocated bytes over a 4 MiB limit");
    assert!(!entries.is_empty(), "the most recent chunks stay");
    assert!(j["cache"]["evictions"].as_u64().unwrap() > 0, "{j}");
    assert!(j["cache"]["bytes_allocated"].as_u64().unwrap() <= 4 << 20, "{j}");
    // A bigger limit later keeps what is there and grows.
    let (r, j) = pull(&format!("{}:v1", fx.repo), &fx.path("b"), Some(&cache), &["--cache-size", "1GiB", "--cache-copy"]);
    ok(&r);
    assert_same_files(&fx.snap1, &fx.path("b"));
    assert!(n(&j, "cached_chunks") >= entries.len() as u64, "{j}");
}

/// Bad input: an unreachable registry and a missing tag are errors (exit 2), not panics.
#[test]
fn pull_errors_are_clear() {
    let work = tempfile::tempdir().unwrap();
    let port = snapctl_tests::free_port();
    let r = run(snapctl().args(["pull", &format!("127.0.0.1:{port}/a/b:v1")]).arg(work.path().join("o")).arg("--no-cache"));
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.stderr.contains(&format!("127.0.0.1:{port}")), "{}", r.stderr);
    let r = run(snapctl().args(["pull", "not a reference"]).arg(work.path().join("o")).arg("--no-cache"));
    assert_eq!(r.code, 2, "{r:?}");
    let r = run(snapctl().args(["pull", "--help"]));
    assert_eq!(r.code, 0);
    assert!(r.stdout.contains("--cache-size") && r.stdout.contains("Examples"), "{}", r.stdout);
}

/// Pulls through a fault-injecting proxy in front of `snapctl serve`: connection resets,
/// 503 bursts and truncated bodies are retried and the pull completes byte-identical; a
/// byte flipped in transit once is caught and the chunk fetched again; a byte flipped in
/// every pack response fails with exit 1 and leaves no file under its final name.
#[test]
fn pull_through_faults_completes_or_fails_verified() {
    use snapctl_tests::fault_proxy::{Fault, FaultProxy, Match, Rule};
    if !have("skopeo") {
        return;
    }
    let (_storage, serve, fx) = Fixture::served("32MiB");
    let proxy = FaultProxy::start(serve.addr.as_str()).unwrap();
    let image = format!("{}/sandboxes/vm:v1", proxy.addr);
    // One chunk per range request: many requests for the faults to land on.
    let small = ["--max-range", "1MiB", "--jobs", "4"];

    let cases: Vec<(&str, Vec<Rule>)> = vec![
        ("resets", vec![Rule::new(Fault::Reset { after: 64 * 1024 }).on(Match::blob_gets()).nth(3).times(3)]),
        ("503 burst", vec![Rule::new(Fault::Status { code: 503 }).times(4)]),
        ("truncated bodies", vec![Rule::new(Fault::Truncate { after: 100 * 1024 }).on(Match::blob_gets()).nth(4).times(2)]),
        (
            "all three",
            vec![
                Rule::new(Fault::Status { code: 503 }).on(Match::blob_gets()).nth(5).times(2),
                Rule::new(Fault::Reset { after: 1000 }).on(Match::blob_gets()).nth(8),
                Rule::new(Fault::Truncate { after: 10 }).on(Match::blob_gets()).nth(12),
            ],
        ),
    ];
    for (what, rules) in cases {
        proxy.clear();
        let faults_before = proxy.faults();
        for r in rules {
            proxy.add(r);
        }
        let dest = fx.path(&format!("out-{}", what.replace(' ', "-")));
        let (r, _) = pull(&image, &dest, None, &small);
        assert_eq!(r.code, 0, "{what}: {r:?}");
        assert!(proxy.faults() > faults_before, "{what}: no fault was injected");
        assert_same_files(&fx.snap1, &dest);
    }

    // One byte flipped in one pack response (blob GETs 1 and 2 are config and index):
    // caught by the chunk digest, the chunk fetched again alone, the file right.
    proxy.clear();
    proxy.add(Rule::new(Fault::FlipByte { at: 0 }).on(Match::blob_gets()).nth(3));
    let dest = fx.path("out-flip-once");
    let (r, j) = pull(&image, &dest, None, &small);
    assert_eq!(r.code, 0, "{r:?}");
    assert_same_files(&fx.snap1, &dest);
    assert_eq!(n(&j, "refetched_chunks"), 1, "{j}");

    // Every pack response damaged: exit 1 with a verification error, no final file, no
    // temp file, and nothing unverified in the cache.
    proxy.clear();
    proxy.add(Rule::new(Fault::FlipByte { at: 0 }).on(Match::blob_gets()).nth(3).times(u64::MAX));
    let dest = fx.path("out-flip-always");
    let cache = fx.path("cache-flip");
    let (r, _) = pull(&image, &dest, Some(&cache), &small);
    assert_eq!(r.code, 1, "{r:?}");
    assert!(r.stderr.contains("digest mismatch") && r.stderr.contains("chunk"), "{}", r.stderr);
    assert_eq!(fs::read_dir(&dest).map(|d| d.count()).unwrap_or(0), 0, "nothing left in {}", dest.display());
    assert!(cache_entries(&cache).0.is_empty(), "no damaged chunk was cached");
}

/// Two pulls at once sharing one cache (and a third from a local layout, which `pull`
/// takes too): all complete byte-identical, and the cache holds each chunk once, intact.
#[test]
fn concurrent_pulls_share_one_cache() {
    if !have("skopeo") {
        return;
    }
    let (_storage, _serve, fx) = Fixture::served("32MiB");
    let cache = fx.path("cache");
    let spawn = |image: String, dest: PathBuf| {
        snapctl()
            .args(["pull", &image])
            .arg(dest)
            .arg("--cache")
            .arg(&cache)
            .args(["--max-range", "2MiB", "--jobs", "3"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let layout = format!("oci:{}:v2", fx.path("layout").display());
    let kids = [
        (spawn(format!("{}:v2", fx.repo), fx.path("a")), fx.path("a")),
        (spawn(format!("{}:v2", fx.repo), fx.path("b")), fx.path("b")),
        (spawn(layout, fx.path("c")), fx.path("c")),
    ];
    for (kid, dest) in kids {
        let out = kid.wait_with_output().unwrap();
        assert!(out.status.success(), "{}: {}", dest.display(), String::from_utf8_lossy(&out.stderr));
        assert_same_files(&fx.snap2, &dest);
    }
    let (entries, _) = cache_entries(&cache);
    for e in entries.iter().filter(|e| e.extension().is_none()) {
        let data = fs::read(e).unwrap();
        assert_eq!(verify::chunk_digest(imgfmt::HashAlgo::Blake3, &data).to_hex(), e.file_name().unwrap().to_str().unwrap());
    }
    assert_eq!(fs::read_dir(cache.join("chunks/v1/tmp")).unwrap().count(), 0, "no temp file left in the cache");
    // Everything is there now.
    let (r, j) = pull(&format!("{}:v2", fx.repo), &fx.path("d"), Some(&cache), &[]);
    ok(&r);
    assert_eq!(n(&j, "bytes_fetched"), 0, "{j}");
}
