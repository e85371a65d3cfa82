//! A guest restored lazily from a tag that moves on keeps every page right through the
//! registry's garbage collection (issue 35 §1): the daemon fills its image into the chunk
//! cache in the background (pinned there), and holds a lease on it that `snapctl serve`
//! honours. The guest (`fake_vmm`) touches three pages, lives on while the next hibernation
//! is pushed to the tag and gc runs, then touches every page and checks each byte.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::lazy::{assert_clean, lazy_available, packed_sample, Handler, Restore, MIB};
use snapctl_tests::registry_support::{Distribution, Serve};
use snapctl_tests::{free_port, have, run, snapctl, uffd_usable};

/// The guest's first touches: three pages of data chunks, fewer misses than start the
/// stream of the rest of the image.
const FIRST_TOUCH: &str = "3,1000,2500";

/// A guest that touches [`FIRST_TOUCH`], then waits for `go` before touching every page of
/// `mem`; on its own thread. Returns once it is waiting, with its handle.
fn guest_waiting_for(sock: &Path, mem: &Path, go: &Path) -> std::thread::JoinHandle<Restore> {
    let (sock, mem, go2) = (sock.to_path_buf(), mem.to_path_buf(), go.to_path_buf());
    let h = std::thread::spawn(move || {
        let r = run(Command::new(env!("CARGO_BIN_EXE_fake_vmm"))
            .arg("--socket")
            .arg(&sock)
            .arg("--mem-file")
            .arg(&mem)
            .args(["--json", "--timeout", "600", "--threads", "2", "--touch", FIRST_TOUCH, "--then-touch", "all", "--then-wait-for"])
            .arg(&go2));
        let json = serde_json::from_str(r.stdout.trim()).unwrap_or(serde_json::Value::Null);
        Restore { code: r.code, json, stderr: r.stderr }
    });
    let mut waiting = go.as_os_str().to_owned();
    waiting.push(".waiting");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !PathBuf::from(&waiting).exists() {
        assert!(!h.is_finished(), "the guest ended before its first touches were done");
        assert!(Instant::now() < deadline, "the guest's first touches took over a minute");
        std::thread::sleep(Duration::from_millis(20));
    }
    h
}

/// A daemon-wide metric from `snapctl lazy --metrics`.
fn metric(addr: &str, name: &str) -> Option<u64> {
    let text = reqwest::blocking::get(format!("http://{addr}/metrics")).ok()?.text().ok()?;
    text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// The manifest `digest` of `repo` at `addr`, and the digests of its layers (`None`: 404).
fn manifest_layers(addr: &str, repo: &str, digest: &str) -> Option<Vec<String>> {
    let r = reqwest::blocking::Client::new()
        .get(format!("http://{addr}/v2/{repo}/manifests/{digest}"))
        .header("Accept", "application/vnd.oci.image.manifest.v1+json")
        .send()
        .unwrap();
    if r.status().as_u16() == 404 {
        return None;
    }
    assert!(r.status().is_success(), "GET manifest {digest}: {}", r.status());
    let m: serde_json::Value = r.json().unwrap();
    Some(m["layers"].as_array().unwrap().iter().map(|l| l["digest"].as_str().unwrap().to_string()).collect())
}

fn blob_status(addr: &str, repo: &str, digest: &str) -> u16 {
    reqwest::blocking::Client::new().head(format!("http://{addr}/v2/{repo}/blobs/{digest}")).send().unwrap().status().as_u16()
}

/// Issue 35 §1, any registry: against distribution 2.8 (Debian's `docker-registry`, which
/// knows nothing of leases), a restore whose guest touched three pages fills the rest of
/// its image into the chunk cache; once that is done (`snapctl_lazy_fill_done`), the next
/// hibernation is pushed to the tag and `docker-registry garbage-collect --delete-untagged`
/// deletes the restored manifest and sweeps its packs. Every page the guest touches then is
/// right. Before, the untouched pages were poisoned (the packs were gone).
#[test]
fn regression_issue_35_a_lazy_restore_outlives_distribution_gc_once_its_image_is_cached() {
    if !uffd_usable() || !lazy_available() || !have("docker-registry") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (snap, layout_ref) = packed_sample(&dir.path().join("a"), "16MiB", "41");
    let (_, next_ref) = packed_sample(&dir.path().join("b"), "16MiB", "42");
    let mem = snap.join("vm.mem");
    let dist_dir = dir.path().join("dist");
    std::fs::create_dir_all(&dist_dir).unwrap();
    let dist = Distribution::start(&dist_dir);
    let image = format!("{}/sbx/vm:latest", dist.addr);
    let r = run(snapctl().args(["push", &layout_ref, &image]));
    assert_eq!(r.code, 0, "push: {r:?}");
    let digest = r.stdout.trim().to_string();
    let packs = manifest_layers(&dist.addr, "sbx/vm", &digest).expect("pushed");

    let metrics = format!("127.0.0.1:{}", free_port());
    let sock = dir.path().join("lazy.sock");
    let cache = dir.path().join("cache");
    let h = Handler::lazy(&image, &sock, &["--cache", cache.to_str().unwrap(), "--metrics", &metrics]);
    let go = dir.path().join("go");
    let guest = guest_waiting_for(&sock, &mem, &go);
    let deadline = Instant::now() + Duration::from_secs(120);
    while metric(&metrics, "snapctl_lazy_fill_done") != Some(1) {
        assert!(Instant::now() < deadline, "the fill never finished: {}", h.log_text());
        std::thread::sleep(Duration::from_millis(100));
    }
    let log = h.log_text();
    assert!(log.contains("no longer depends on the registry"), "{log}");
    assert!(log.contains("does not honour restore leases"), "distribution echoes no lease: {log}");
    assert!(metric(&metrics, "snapctl_lazy_filled_chunks_total").unwrap() > 0);
    assert_eq!(metric(&metrics, "snapctl_lazy_streamed_chunks_total"), Some(0), "three touches start no stream");

    // The next hibernation goes to the tag; gc deletes what no tag names, packs and all.
    let r = run(snapctl().args(["push", &next_ref, &image]));
    assert_eq!(r.code, 0, "push: {r:?}");
    let gc = run(Command::new("docker-registry").args(["garbage-collect", "--delete-untagged"]).arg(dist_dir.join("config.yml")));
    assert_eq!(gc.code, 0, "garbage-collect: {gc:?}");
    assert!(manifest_layers(&dist.addr, "sbx/vm", &digest).is_none(), "gc deleted the restored manifest");
    let swept = packs.iter().filter(|p| blob_status(&dist.addr, "sbx/vm", p) == 404).count();
    assert!(swept > 0, "gc swept the restored image's blobs: {gc:?}");

    std::fs::write(&go, b"").unwrap();
    let r = guest.join().unwrap();
    // Every page, and the first three again.
    assert_clean(&r, 16 * MIB / 4096 + 3);
}

/// Issue 35 §1: while a lazy daemon runs, its image's chunks are pinned in the cache across
/// processes: `snapctl cache prune --all` leaves them, `snapctl cache --json` counts them
/// as pinned. A daemon killed with -9 leaves a pin nobody holds: the next command that
/// reads the cache deletes it, and the chunks are ordinary entries again.
#[test]
fn regression_issue_35_a_running_restore_pins_its_chunks_against_prune_all() {
    if !uffd_usable() || !lazy_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (snap, image) = packed_sample(dir.path(), "16MiB", "43");
    let cache = dir.path().join("cache");
    let metrics = format!("127.0.0.1:{}", free_port());
    let sock = dir.path().join("lazy.sock");
    let mut h = Handler::lazy(&image, &sock, &["--cache", cache.to_str().unwrap(), "--metrics", &metrics]);
    let go = dir.path().join("go");
    let guest = guest_waiting_for(&sock, &snap.join("vm.mem"), &go);
    let deadline = Instant::now() + Duration::from_secs(120);
    while metric(&metrics, "snapctl_lazy_fill_done") != Some(1) {
        assert!(Instant::now() < deadline, "the fill never finished: {}", h.log_text());
        std::thread::sleep(Duration::from_millis(100));
    }
    let cache_cmd = |args: &[&str]| {
        let r = run(snapctl().args(["cache", "--cache", cache.to_str().unwrap()]).args(args));
        assert_eq!(r.code, 0, "{r:?}");
        r
    };
    let usage = |r: &snapctl_tests::Run| -> serde_json::Value { serde_json::from_str(&r.stdout).unwrap() };
    let pruned = cache_cmd(&["prune", "--all", "--json"]);
    let u = usage(&pruned);
    let chunks = u["kinds"][0]["entries"].as_u64().unwrap();
    assert!(chunks > 0, "prune --all left the pinned chunks: {u}");
    assert_eq!((u["pins"].as_u64(), u["kinds"][0]["in_use"].as_u64()), (Some(1), Some(chunks)), "{u}");
    assert!(u["pinned_bytes"].as_u64().unwrap() >= chunks * MIB, "{u}");
    assert!(pruned.stderr.contains("in use kept"), "{}", pruned.stderr);
    assert!(cache_cmd(&[]).stdout.contains("chunks kept for 1 running restore(s)"));

    std::fs::write(&go, b"").unwrap();
    assert_clean(&guest.join().unwrap(), 16 * MIB / 4096 + 3);

    // Killed outright: its pin is nobody's, and goes with the next look.
    h.child.kill().unwrap();
    h.child.wait().unwrap();
    let u = usage(&cache_cmd(&["--json"]));
    assert_eq!((u["pins"].as_u64(), u["pinned_bytes"].as_u64()), (Some(0), Some(0)), "{u}");
    assert!(std::fs::read_dir(cache.join("chunks/v1/pins")).unwrap().next().is_none(), "the dead daemon's pin file was deleted");
    let u = usage(&cache_cmd(&["prune", "--all", "--json"]));
    assert_eq!(u["kinds"][0]["entries"].as_u64(), Some(0), "{u}");
}

/// Issue 35 §1, `snapctl serve`: a guest restored lazily from a tag that moves on keeps every
/// page right through three gc runs with a 1 s grace after the tag moved. The fill is off,
/// so what keeps the image's packs is the lease the daemon holds on its manifest (taken at
/// the wake, renewed, honoured by serve's gc as if the manifest were tagged). Once the
/// daemon has ended cleanly (its lease released), the next gc after the grace deletes the
/// image. Before, the first gc deleted it and the guest's untouched data pages were poisoned.
#[test]
fn regression_issue_35_a_lazy_restore_keeps_every_page_through_three_serve_gcs() {
    if !uffd_usable() || !lazy_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (snap, layout_ref) = packed_sample(&dir.path().join("a"), "16MiB", "44");
    let (_, next_ref) = packed_sample(&dir.path().join("b"), "16MiB", "45");
    let storage = dir.path().join("storage");
    let serve = Serve::start(storage.to_str().unwrap(), &[], &[]);
    let image = format!("{}/sbx/vm:latest", serve.addr);
    let r = run(snapctl().args(["push", &layout_ref, &image]));
    assert_eq!(r.code, 0, "push: {r:?}");
    let digest = r.stdout.trim().to_string();
    let packs = manifest_layers(&serve.addr, "sbx/vm", &digest).expect("pushed");

    let sock = dir.path().join("lazy.sock");
    let cache = dir.path().join("cache");
    let mut h = Handler::lazy(&image, &sock, &["--cache", cache.to_str().unwrap(), "--fill", "off"]);
    let go = dir.path().join("go");
    let guest = guest_waiting_for(&sock, &snap.join("vm.mem"), &go);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !h.log_text().contains("lease on") {
        assert!(Instant::now() < deadline, "no lease taken: {}", h.log_text());
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(h.log_text().contains(&format!("sbx/vm@{digest} at the registry: 900 s")), "{}", h.log_text());

    // The next hibernation moves the tag; gc runs three times with a 1 s grace.
    let r = run(snapctl().args(["push", &next_ref, &image]));
    assert_eq!(r.code, 0, "push: {r:?}");
    let gc = || {
        std::thread::sleep(Duration::from_millis(1200));
        let r = run(snapctl().args(["gc", "--storage", storage.to_str().unwrap(), "--grace", "1s", "--json"]));
        assert_eq!(r.code, 0, "gc: {r:?}");
    };
    for _ in 0..3 {
        gc();
        assert!(manifest_layers(&serve.addr, "sbx/vm", &digest).is_some(), "gc kept the leased manifest");
        assert!(packs.iter().all(|p| blob_status(&serve.addr, "sbx/vm", p) == 200), "gc kept its blobs");
    }
    std::fs::write(&go, b"").unwrap();
    assert_clean(&guest.join().unwrap(), 16 * MIB / 4096 + 3);

    // A clean exit releases the lease: the image is the gc's once the grace has passed.
    // SAFETY: kill(2) with a pid and a signal number touches no memory.
    assert_eq!(unsafe { libc::kill(h.child.id() as i32, libc::SIGTERM) }, 0);
    assert_eq!(h.wait_exit(Duration::from_secs(30)), 0, "{}", h.log_text());
    gc();
    assert!(manifest_layers(&serve.addr, "sbx/vm", &digest).is_none(), "released, the untagged manifest goes");
}
