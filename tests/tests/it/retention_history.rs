//! Issue 22's "Done when" for retention: thirty days of a small fleet, simulated on a clock
//! the test controls, then retention. Three sandboxes hibernate in turn, 300 pushes in
//! all, each a layer over the sandbox's previous snapshot (`--parent`, rebased every 17)
//! on a shared base, tagged `<sandbox>-latest` and `<sandbox>-h<step>`; a trace is
//! attached to every fourth; some snapshots are deleted by a client; the base is replaced
//! halfway; pulls happen at times the test sets. Retention must keep exactly what the
//! policy says (and what kept snapshots need), every kept snapshot must verify and
//! lazy-restore, and the store must hold little more than the kept images' unique bytes.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use imgfmt::{Image, OciDigest, OciLayout};
use registry::retention::{Action, RetentionConfig, Rule};
use snapctl_tests::{run, snapctl, uffd_usable, SplitMix64};

const CHUNK: usize = 64 << 10;
/// vm.mem: 16 chunks, four of them holes.
const MEM: usize = 16 * CHUNK;
const STEPS: usize = 300;
const SANDBOXES: [&str; 3] = ["a", "b", "c"];
const REPO: &str = "fleet/vm";
/// The step at which the base is replaced and sandbox `c` starts over on the new one.
const NEW_BASE_AT: usize = 150;
const DAY: Duration = Duration::from_secs(86400);

const POLICY: &str = r#"
delay = "1h"
[[policies]]
repositories = ["fleet/**"]
keep_tags = [
  { patterns = ["golden", ".*-latest"] },
  { patterns = [".*-h[0-9]+"], most_recently_pushed_count = 6 },
  { patterns = [".*-h[0-9]+"], pulled_within = "3d" },
]
"#;

/// `snapctl serve`'s server, in this process (the test sets pull times through its log).
struct Registry {
    rt: tokio::runtime::Runtime,
    server: Arc<registry::Server>,
    store: Arc<dyn registry::BlobStore>,
    root: PathBuf,
    addr: String,
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl Registry {
    fn start(root: &Path) -> Registry {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let store: Arc<dyn registry::BlobStore> = Arc::new(registry::store::FsStore::open(root).unwrap());
        let server = registry::Server::new(store.clone(), registry::Config::default());
        let l = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        rt.spawn(server.clone().serve(l, async {
            let _ = rx.await;
        }));
        Registry { rt, server, store, root: root.to_path_buf(), addr, _stop: tx }
    }

    fn client(&self) -> regclient::RegistrySource {
        regclient::RegistrySource::new(&self.addr, REPO, true, None).unwrap()
    }

    /// Set the mtime of the store object `key` (a tag, a manifest link): when it was pushed.
    fn stamp(&self, key: &str, t: SystemTime) {
        let p = self.root.join(key);
        fs::File::options().write(true).open(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display())).set_modified(t).unwrap();
    }
}

/// The contents of vm.mem after a list of chunk rewrites (chunk, seed) over a start.
fn mem_of(start: &[u8], writes: &[(usize, u64)]) -> Vec<u8> {
    let mut m = start.to_vec();
    for &(c, seed) in writes {
        let mut rng = SplitMix64(seed);
        for w in m[c * CHUNK..(c + 1) * CHUNK].chunks_mut(8) {
            w.copy_from_slice(&rng.next_u64().to_le_bytes());
        }
    }
    m
}

fn golden(version: u64) -> Vec<u8> {
    let mut m = vec![0u8; MEM];
    let data: Vec<usize> = (0..16).filter(|c| c % 4 != 3).collect(); // chunks 3, 7, 11, 15: holes
    let writes: Vec<(usize, u64)> = data.iter().map(|&c| (c, 7000 + c as u64)).collect();
    m = mem_of(&m, &writes);
    if version == 2 {
        m = mem_of(&m, &[(0, 9000), (5, 9001), (9, 9002)]);
    }
    m
}

/// Write a snapshot directory holding `mem`.
fn write_snapshot(dir: &Path, mem: &[u8]) {
    fs::create_dir_all(dir).unwrap();
    let f = fs::File::create(dir.join("vm.mem")).unwrap();
    f.set_len(MEM as u64).unwrap();
    // Zero chunks stay holes, as a hibernated guest's untouched memory is.
    for (c, chunk) in mem.chunks(CHUNK).enumerate() {
        if chunk.iter().any(|&b| b != 0) {
            f.write_all_at(chunk, (c * CHUNK) as u64).unwrap();
        }
    }
    fs::write(dir.join("vm.state"), b"device state\n".repeat(50)).unwrap();
}

/// One pushed snapshot.
#[derive(Debug, Clone)]
struct Pushed {
    digest: OciDigest,
    step: usize,
    /// vm.mem, rebuilt when needed: the start it grew from and the chunk rewrites since.
    start: u64,
    writes: Vec<(usize, u64)>,
}

#[test]
fn retention_over_a_simulated_month_keeps_exactly_what_the_policy_says() {
    let work = tempfile::tempdir().unwrap();
    let reg = Registry::start(&work.path().join("store"));
    let client = reg.client();
    let layout = OciLayout::open_or_create(work.path().join("layout")).unwrap();
    let http = reqwest::blocking::Client::new();
    let end = SystemTime::now() - 2 * DAY;
    let begin = end - 28 * DAY;
    let at = |step: usize| begin + (28 * DAY).mul_f64(step as f64 / STEPS as f64);
    let copy_opts = pusher::CopyOptions { upload: regclient::UploadOptions { cache_dir: None, ..Default::default() }, ..Default::default() };
    let tag_key = |t: &str| format!("repositories/{REPO}/_tags/{t}");
    let link_key = |d: &OciDigest| format!("repositories/{REPO}/_manifests/{}/{}", d.algorithm(), d.hex());

    // Pack a snapshot into the layout (a layer over `parent`, on `base`), push it with
    // `tags` at simulated time `t`.
    let push = |name: &str, mem: &[u8], parent: Option<&OciDigest>, base: Option<&OciDigest>, tags: &[String], t: SystemTime| -> OciDigest {
        let dir = work.path().join("snap").join(name);
        write_snapshot(&dir, mem);
        let related =
            |d: &OciDigest, what: &str| pusher::Related { source: &layout, image: Image::open(&layout, d).unwrap(), reference: format!("{REPO}:{what}") };
        let opts = pusher::PackOptions {
            chunk_shift: 16,
            max_chain: 16,
            threads: 2,
            parent: parent.map(|p| related(p, "parent")),
            base: base.map(|b| related(b, "golden")),
            ..Default::default()
        };
        let rep = pusher::pack(&dir, &layout, name, &opts).unwrap();
        let d: OciDigest = rep.manifest.parse().unwrap();
        pusher::copy(&layout, &d, &pusher::Target::Registry(&client), Some(&tags[0]), &copy_opts).unwrap();
        let bytes = imgfmt::source::read_verified_blob(&layout, &d, 1 << 22).unwrap();
        for t in &tags[1..] {
            client.put_manifest(t, &bytes).unwrap();
        }
        reg.stamp(&link_key(&d), t);
        for tag in tags {
            reg.stamp(&tag_key(tag), t);
        }
        d
    };

    let golden1 = push("golden1", &golden(1), None, None, &["golden".into()], begin - DAY);
    let mut golden2 = None;
    let mut heads: HashMap<&str, Pushed> = HashMap::new();
    let mut pushed: Vec<Pushed> = Vec::new();
    let mut traces: Vec<(OciDigest, OciDigest)> = Vec::new(); // (trace, subject)
    let mut deleted: BTreeSet<OciDigest> = BTreeSet::new();
    let mut rng = SplitMix64(22);
    for step in 0..STEPS {
        let t = at(step);
        if step == NEW_BASE_AT {
            golden2 = Some(push("golden2", &golden(2), None, None, &["golden".into()], t - Duration::from_secs(600)));
            heads.remove("c"); // c starts over on the new base
        }
        let sb = SANDBOXES[step % SANDBOXES.len()];
        let (start, base) = match (sb, golden2.as_ref()) {
            ("c", Some(g2)) => (2, g2.clone()),
            _ => (1, golden1.clone()),
        };
        let prev = heads.get(sb).cloned();
        let mut writes = prev.as_ref().map(|p| p.writes.clone()).unwrap_or_default();
        let chunk = [0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14][(rng.next_u64() % 12) as usize];
        writes.push((chunk, 100_000 + step as u64));
        let mem = mem_of(&golden(start), &writes);
        let tags = vec![format!("{sb}-latest"), format!("{sb}-h{step}")];
        let d = push(sb, &mem, prev.as_ref().map(|p| &p.digest), Some(&base), &tags, t);
        let p = Pushed { digest: d.clone(), step, start, writes };
        heads.insert(sb, p.clone());
        pushed.push(p);
        if step % 4 == 0 {
            // A trace of a restore an hour later, with its working set. (The image is read
            // from the layout: a GET from the registry would be a pull, at the real time.)
            let image = Image::open(&layout, &d).unwrap();
            let ws: Vec<u8> = (0..2048).flat_map(|_| rng.next_u64().to_le_bytes()).collect();
            let trace = lazy::Trace::new("vm.mem", CHUNK as u64, vec![0, 1, 2]);
            use lazy::TraceStore as _;
            let (_, td) = lazy::RegistryTraces::new(Arc::new(reg.client())).store(&image, &trace, &ws).unwrap();
            reg.stamp(&link_key(&td), t + Duration::from_secs(3600));
            traces.push((td, d.clone()));
        }
        if step % 23 == 11 {
            // A client deletes a snapshot of five steps ago (never a sandbox's head).
            let victim = &pushed[step - 5];
            if heads.values().all(|h| h.digest != victim.digest) && !deleted.contains(&victim.digest) {
                let r = http.delete(format!("http://{}/v2/{REPO}/manifests/{}", reg.addr, victim.digest)).send().unwrap();
                assert_eq!(r.status().as_u16(), 202);
                deleted.insert(victim.digest.clone());
            }
        }
    }
    assert!(!deleted.is_empty() && traces.len() >= 70, "the history has deletions and traces");

    // Pulls, on the test's clock: every seventh snapshot, some within the last 3 days.
    let now = SystemTime::now();
    let repo = registry::RepoName::parse(REPO).unwrap();
    let mut pulled: HashMap<OciDigest, SystemTime> = HashMap::new();
    for p in pushed.iter().filter(|p| p.step % 7 == 3) {
        // Half-hour offsets: no pull sits on the 3-day boundary gc measures a moment later.
        let t = now - Duration::from_secs(3600 * (1 + (p.step as u64 * 13) % 240) + 1800);
        reg.server.pulls.record_at(&repo, &p.digest, t);
        pulled.insert(p.digest.clone(), t);
    }
    reg.rt.block_on(reg.server.pulls.flush(reg.store.as_ref())).unwrap();

    // What the policy says, worked out here from the history alone.
    let alive: Vec<&Pushed> = pushed.iter().filter(|p| !deleted.contains(&p.digest)).collect();
    let mut h_by_push: Vec<&Pushed> = alive.clone();
    h_by_push.sort_by_key(|p| std::cmp::Reverse(p.step));
    let mut keep: BTreeSet<OciDigest> = [heads["a"].digest.clone(), heads["b"].digest.clone(), heads["c"].digest.clone()].into();
    keep.extend(h_by_push.iter().take(6).map(|p| p.digest.clone()));
    keep.extend(alive.iter().filter(|p| pulled.get(&p.digest).is_some_and(|t| now.duration_since(*t).unwrap() <= 3 * DAY)).map(|p| p.digest.clone()));
    let kept_snapshots = keep.clone();
    keep.insert(golden2.clone().unwrap());
    // golden1 is untagged since the new base; kept snapshots of a and b name it as base.
    keep.insert(golden1.clone());
    let kept_traces: BTreeSet<OciDigest> = traces.iter().filter(|(_, s)| keep.contains(s)).map(|(t, _)| t.clone()).collect();
    keep.extend(kept_traces.iter().cloned());
    let linked: BTreeSet<OciDigest> =
        alive.iter().map(|p| p.digest.clone()).chain([golden1.clone(), golden2.clone().unwrap()]).chain(traces.iter().map(|(t, _)| t.clone())).collect();
    let expected_deleted: BTreeSet<OciDigest> = linked.difference(&keep).cloned().collect();
    assert!(kept_snapshots.len() >= 9 && expected_deleted.len() > 200, "kept {} snapshots, {} manifests to go", kept_snapshots.len(), expected_deleted.len());

    // Retention, as `snapctl gc` runs it: a dry run first, then the real one.
    std::thread::sleep(Duration::from_millis(50)); // gc starts after the last use mark's tick
    let retention = registry::retention::Retention::new(toml::from_str::<RetentionConfig>(POLICY).unwrap()).unwrap();
    let opts = registry::gc::GcOptions { grace: Duration::ZERO, retention, ..Default::default() };
    let dry = reg.rt.block_on(registry::gc::run(reg.store.as_ref(), &registry::gc::GcOptions { dry_run: true, ..opts.clone() })).unwrap();
    let verdict: BTreeMap<&OciDigest, (&Action, &Rule)> = dry.retention.manifests.iter().map(|v| (&v.digest, (&v.action, &v.rule))).collect();
    assert_eq!(verdict.keys().cloned().cloned().collect::<BTreeSet<_>>(), linked, "a verdict for every linked manifest");
    let got_deleted: BTreeSet<OciDigest> = dry.retention.deleted_manifests().map(|v| v.digest.clone()).collect();
    let kept_too: Vec<_> = expected_deleted.difference(&got_deleted).map(|d| (d, verdict[d])).collect();
    let deleted_too: Vec<_> = got_deleted.difference(&expected_deleted).map(|d| (d, verdict[d])).collect();
    assert!(
        kept_too.is_empty() && deleted_too.is_empty(),
        "retention keeps exactly what the policy says; kept too: {kept_too:?}; deleted too: {deleted_too:?}"
    );
    assert!(matches!(verdict[&golden1].1, Rule::Base { .. }), "the old base stays for what names it: {:?}", verdict[&golden1]);
    for (t, s) in &traces {
        let want = if keep.contains(s) { Rule::Referrer { subject: s.clone() } } else { Rule::SubjectGone { subject: s.clone() } };
        assert_eq!(verdict[t].1, &want, "trace {t} of {s}");
    }
    let dry_bytes: u64 = dry.retention.deleted_manifests().map(|v| v.bytes + v.shared_bytes).sum();
    // Snapshots clients deleted left blobs no manifest lists before the run: the sweep
    // frees those too, and no verdict counts them.
    assert!(dry_bytes > 0 && dry_bytes <= dry.swept_bytes, "the verdicts' bytes ({dry_bytes}) are part of what the sweep frees ({})", dry.swept_bytes);
    let before = crate::retention::disk_bytes(&reg.root.join("blobs"));
    let rep = reg.rt.block_on(registry::gc::run(reg.store.as_ref(), &opts)).unwrap();
    assert_eq!(rep.manifests_removed, expected_deleted.len(), "{:?}", rep.retention.manifests.iter().filter(|v| v.rule == Rule::InUse).collect::<Vec<_>>());
    assert_eq!(rep.swept_bytes, dry.swept_bytes);
    let again = reg.rt.block_on(registry::gc::run(reg.store.as_ref(), &opts)).unwrap();
    assert_eq!((again.manifests_removed, again.tags_removed, again.swept), (0, 0, 0), "a second run finds nothing more");

    // The registry now: kept manifests answer, the others do not, referrers follow.
    for d in &linked {
        let st = http.head(format!("http://{}/v2/{REPO}/manifests/{d}", reg.addr)).send().unwrap().status().as_u16();
        assert_eq!(st, if keep.contains(d) { 200 } else { 404 }, "{d}");
    }
    for (t, s) in &traces {
        let listed = client.list_referrers(s, None).unwrap();
        assert_eq!(listed.iter().any(|x| &x.digest == t), kept_traces.contains(t), "referrers of {s}");
    }

    // The store holds the kept images' unique bytes, and little else.
    let mut unique: BTreeMap<OciDigest, u64> = BTreeMap::new();
    for d in &keep {
        let b = imgfmt::source::read_verified_blob(&client, d, 1 << 22).unwrap();
        let m = imgfmt::Manifest::decode(&b).unwrap();
        unique.insert(d.clone(), b.len() as u64);
        for x in std::iter::once(&m.config).chain(&m.layers) {
            unique.insert(x.digest.clone(), x.size);
        }
    }
    let unique_bytes: u64 = unique.values().sum();
    let after = crate::retention::disk_bytes(&reg.root.join("blobs"));
    eprintln!(
        "blobs before retention {before} bytes, after {after}; kept images' unique bytes {unique_bytes} ({} manifests kept, {} deleted)",
        keep.len(),
        expected_deleted.len()
    );
    assert!(after >= unique_bytes && after as f64 <= unique_bytes as f64 * 1.05, "store {after} bytes against {unique_bytes} unique bytes of the kept images");

    // Every kept snapshot verifies, from the registry, and lazy-restores page for page.
    let mems: HashMap<OciDigest, Vec<u8>> = pushed
        .iter()
        .map(|p| (p.digest.clone(), mem_of(&golden(p.start), &p.writes)))
        .chain([(golden1.clone(), golden(1)), (golden2.clone().unwrap(), golden(2))])
        .collect();
    let snapshots: Vec<&OciDigest> = keep.iter().filter(|d| mems.contains_key(*d)).collect();
    assert_eq!(snapshots.len(), kept_snapshots.len() + 2);
    let lazy_ok = uffd_usable() && crate::lazy::lazy_available();
    for (i, d) in snapshots.iter().enumerate() {
        let reference = format!("{}/{REPO}@{d}", reg.addr);
        let cache = work.path().join(format!("cache-{i}"));
        let r = run(snapctl().env("SNAPCTL_CACHE", &cache).args(["verify", &reference]));
        assert_eq!(r.code, 0, "verify {reference}: {r:?}");
        if !lazy_ok {
            continue;
        }
        let mem = work.path().join(format!("expect-{i}.mem"));
        fs::write(&mem, &mems[*d]).unwrap();
        let sock = work.path().join(format!("lazy-{i}.sock"));
        let mut h = crate::lazy::Handler::lazy(&reference, &sock, &["--once", "--cache", cache.to_str().unwrap()]);
        let restore = crate::lazy::fake_vmm(&sock, &mem, &["--threads", "2"]);
        crate::lazy::assert_clean(&restore, (MEM / 4096) as u64);
        assert_eq!(h.wait_exit(Duration::from_secs(30)), 0, "lazy {reference}: {}", h.log_text());
    }
}
