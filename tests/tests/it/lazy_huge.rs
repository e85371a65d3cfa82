//! Lazy restore of a guest on 2 MiB huge pages (hugetlbfs), as Firecracker runs one with
//! `"huge_pages": "2M"`: fake_vmm maps its memory MAP_HUGETLB and says so in the handshake;
//! a fault anywhere in a huge page is served by installing the whole page, from every
//! chunk under it, each verified first.
//!
//! Each test reserves the huge pages it maps (`/proc/sys/vm/nr_hugepages`, given back
//! after); where that is not possible they skip loudly, or fail under
//! SNAPCTL_REQUIRE_PEERS=1, as the other lazy tests do without userfaultfd.

use std::fs;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Duration;

use serde_json::Value;
use snapctl_tests::{run, uffd_usable, HugePages};

use crate::lazy::{assert_clean, fake_vmm, lazy_available, n, packed_sample, Handler, Restore, MIB};

const HUGE: u64 = 2 * MIB;
/// Guest pages (4 KiB) per huge page.
const PER_HUGE: u64 = HUGE / 4096;

/// The memory file's 2 MiB pages: for each, whether all its bytes are zero.
fn huge_pages_zero(mem: &Path) -> Vec<bool> {
    let f = fs::File::open(mem).unwrap();
    let len = f.metadata().unwrap().len();
    assert_eq!(len % HUGE, 0, "the sample is whole huge pages");
    let mut buf = vec![0u8; HUGE as usize];
    (0..len / HUGE)
        .map(|h| {
            f.read_exact_at(&mut buf, h * HUGE).unwrap();
            buf.iter().all(|&b| b == 0)
        })
        .collect()
}

/// fake_vmm giving up after `timeout` seconds (`fake_vmm` allows a minute).
fn fake_vmm_within(socket: &Path, mem: &Path, timeout: u64, extra: &[&str]) -> Restore {
    let r = run(std::process::Command::new(env!("CARGO_BIN_EXE_fake_vmm"))
        .arg("--socket")
        .arg(socket)
        .arg("--mem-file")
        .arg(mem)
        .args(["--json", "--timeout", &timeout.to_string()])
        .args(extra));
    let json = serde_json::from_str(r.stdout.trim()).unwrap_or(Value::Null);
    Restore { code: r.code, json, stderr: r.stderr }
}

/// Distinct huge pages a touch list (file page numbers) falls in.
fn huge_pages_of(pages: &[u64]) -> std::collections::BTreeSet<u64> {
    pages.iter().map(|p| p / PER_HUGE).collect()
}

/// Every page of a 32 MiB huge-page guest read back right, every touch pattern: all of it,
/// scattered single pages, clustered runs, and all of it again with the stream installing
/// ahead of the guest. Zero huge pages are among them and are never fetched. Faults reach
/// the daemon at most once per huge page installed (the rest find it present), and no
/// slice is ever fetched (a huge page is filled whole or not at all).
#[test]
fn huge_page_guest_restores_every_page_right_for_every_pattern() {
    if !uffd_usable() || !lazy_available() {
        return;
    }
    let Some(_reserved) = HugePages::reserve(16) else { return };
    let dir = tempfile::tempdir().unwrap();
    let (snap, image) = packed_sample(dir.path(), "32MiB", "5");
    let mem = snap.join("vm.mem");
    let zero = huge_pages_zero(&mem);
    assert!(zero.iter().any(|&z| z) && zero.iter().any(|&z| !z), "the sample has zero and data huge pages: {zero:?}");
    let cases: [(&str, &[&str], &[&str]); 4] = [
        ("all", &["--threads", "4"], &["--prefetch", "none"]),
        ("scattered", &["--threads", "2", "--touch", "3%", "--run-pages", "1"], &["--prefetch", "none"]),
        ("clustered", &["--threads", "2", "--touch", "10%", "--run-pages", "64"], &["--prefetch", "none"]),
        ("streamed", &["--threads", "2"], &["--prefetch", "all", "--prefetch-rate", "0"]),
    ];
    for (what, touch, lazy) in cases {
        let sock = dir.path().join(format!("{what}.sock"));
        let cache = dir.path().join(format!("cache-{what}"));
        let mut args = vec!["--once", "--cache", cache.to_str().unwrap()];
        args.extend_from_slice(lazy);
        let mut h = Handler::lazy(&image, &sock, &args);
        let mut vmm = vec!["--page-size", "2MiB", "--seed", "9"];
        vmm.extend_from_slice(touch);
        let r = fake_vmm(&sock, &mem, &vmm);
        let pages = n(&r.json, &["pages_checked"]);
        assert_clean(&r, pages);
        assert_eq!(n(&r.json, &["page_size"]), HUGE, "{what}: {r:?}");
        if what == "all" || what == "streamed" {
            assert_eq!(pages, 32 * MIB / 4096, "{what}: every page: {r:?}");
        }
        assert!(n(&r.json, &["zero_pages_seen"]) > 0, "{what}: zero pages among those read: {r:?}");
        assert_eq!(h.wait_exit(Duration::from_secs(30)), 0, "{what}: {}", h.log_text());
        let rep = &h.reports(1, Duration::from_secs(1))[0];
        assert_eq!((n(rep, &["verify_failures"]), n(rep, &["poisoned_pages"])), (0, 0), "{what}: {rep}");
        assert_eq!(n(rep, &["slice_bytes"]), 0, "{what}: a huge page is never filled by slices: {rep}");
        // Installs by faults: one per huge page at most (16 in the guest); any other fault
        // found its page present (a second vCPU on the same huge page).
        let installs = n(rep, &["faults", "total"]) - n(rep, &["faults", "present"]);
        assert!(installs <= 16, "{what}: {installs} installs for 16 huge pages: {rep}");
        // Whole chunks only, data chunks only: never more than the data huge pages' chunks.
        let data_chunks = 2 * zero.iter().filter(|&&z| !z).count() as u64;
        assert_eq!(n(rep, &["bytes_fetched"]) % MIB, 0, "{what}: whole 1 MiB chunks: {rep}");
        assert!(n(rep, &["bytes_fetched"]) / MIB <= data_chunks, "{what}: {rep}");
        match what {
            "all" => {
                assert!(n(rep, &["faults", "zero"]) > 0, "zero huge pages installed as zeros: {rep}");
                assert_eq!(installs, 16, "every huge page faulted in once: {rep}");
            }
            "streamed" => assert!(n(rep, &["prefetched_bytes"]) > 0, "the stream installed huge pages: {rep}"),
            _ => {}
        }
    }
}

/// The same 4 KiB touches on 4 KiB pages and on 2 MiB pages: the huge-page restore takes
/// one fault per huge page where the 4 KiB one takes one per page (less whatever a fetched
/// chunk installs ahead), and both read every touched byte right.
#[test]
fn huge_pages_take_one_fault_per_huge_page() {
    if !uffd_usable() || !lazy_available() {
        return;
    }
    let Some(_reserved) = HugePages::reserve(8) else { return };
    let dir = tempfile::tempdir().unwrap();
    let (snap, image) = packed_sample(dir.path(), "16MiB", "23");
    let mem = snap.join("vm.mem");
    // Three pages in each of four data huge pages, touched by one vCPU (so no fault races
    // another on its page).
    let zero = huge_pages_zero(&mem);
    let data: Vec<u64> = (0..zero.len() as u64).filter(|&h| !zero[h as usize]).take(4).collect();
    assert_eq!(data.len(), 4, "{zero:?}");
    let pages: Vec<u64> = data.iter().flat_map(|h| [h * PER_HUGE + 3, h * PER_HUGE + 200, h * PER_HUGE + 511]).collect();
    let list = pages.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
    let mut faults = Vec::new();
    for page in ["4KiB", "2MiB"] {
        let sock = dir.path().join(format!("{page}.sock"));
        let mut h = Handler::lazy(&image, &sock, &["--once", "--prefetch", "none", "--no-cache", "--slice-faults", "off"]);
        let r = fake_vmm(&sock, &mem, &["--page-size", page, "--threads", "1", "--touch", &list]);
        assert_clean(&r, pages.len() as u64);
        assert_eq!(h.wait_exit(Duration::from_secs(30)), 0, "{page}: {}", h.log_text());
        let rep = h.reports(1, Duration::from_secs(1))[0].clone();
        faults.push((n(&rep, &["faults", "total"]), n(&r.json, &["pages_missing_at_touch"]), rep));
    }
    let (small, huge) = (&faults[0], &faults[1]);
    assert_eq!(huge.0, huge_pages_of(&pages).len() as u64, "one fault per huge page: {}", huge.2);
    assert_eq!(huge.1, 4, "the first touch of each huge page found it missing, no other: {}", huge.2);
    // On 4 KiB pages each 1 MiB chunk (256 pages) is installed at its first fault: pages 3
    // and 200 of a huge page share a chunk, 511 is in the next one.
    assert_eq!(small.0, 8, "one fault per chunk touched on 4 KiB pages: {}", small.2);
}

/// A chunk that fails verification under a huge page: the whole huge page is poisoned,
/// none of it installed, not even the half whose chunk is intact, and the daemon names the
/// chunk. The guest touches only the intact half, so the bad chunk is reached through its
/// sibling.
#[test]
fn tampered_chunk_under_a_huge_page_fails_closed() {
    if !uffd_usable() || !lazy_available() {
        return;
    }
    let Some(_reserved) = HugePages::reserve(8) else { return };
    let dir = tempfile::tempdir().unwrap();
    let (snap, image) = packed_sample(dir.path(), "16MiB", "17");
    let mem = snap.join("vm.mem");
    let chunk = snapctl_tests::tamper_first_stored_chunk(&dir.path().join("layout"), "v1", "vm.mem");
    let sibling = chunk ^ 1;
    let huge_page = chunk / 2;
    let sock = dir.path().join("lazy.sock");
    let mut h = Handler::lazy(&image, &sock, &["--once", "--prefetch", "none", "--no-cache"]);
    // Every 4 KiB page of the sibling chunk's half of the huge page.
    let first = sibling * (MIB / 4096);
    let touch = format!("{}-{}", first, first + MIB / 4096 - 1);
    let r = fake_vmm_within(&sock, &mem, 20, &["--page-size", "2MiB", "--threads", "2", "--touch", &touch]);
    assert_eq!(n(&r.json, &["mismatches"]), 0, "no wrong byte reaches the guest: {r:?}");
    assert_eq!(r.json["stalled"], Value::Bool(false), "poisoned, not stalled: {r:?}");
    assert_eq!(n(&r.json, &["poisoned"]), MIB / 4096, "every touched page of the huge page is poisoned, none installed: {r:?}");
    assert_eq!(r.code, 3, "{r:?}");
    assert_eq!(h.wait_exit(Duration::from_secs(30)), 1, "a poisoned restore exits 1: {}", h.log_text());
    let rep = &h.reports(1, Duration::from_secs(1))[0];
    assert!(n(rep, &["verify_failures"]) >= 1, "{rep}");
    assert_eq!(n(rep, &["poisoned_pages"]), 1, "one huge page poisoned: {rep}");
    let log = h.log_text();
    let said = log.lines().find(|l| l.contains("POISONING")).unwrap_or_else(|| panic!("the daemon says what it poisoned: {log}"));
    assert!(said.contains(&format!("chunk {chunk}:")), "the error names the tampered chunk {chunk}: {said}");
    assert!(said.contains(&format!("+{HUGE:#x}")) && said.contains(&format!("file offset {:#x}", huge_page * HUGE)), "the whole huge page: {said}");
}

/// A runtime whose handshake gives a page size that is neither 4 KiB nor 2 MiB is refused
/// at the handshake, with the reason in the log; the daemon goes on serving the next one.
#[test]
fn handshake_with_a_page_size_not_served_is_refused() {
    if !uffd_usable() || !lazy_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (snap, image) = packed_sample(dir.path(), "16MiB", "3");
    let mem = snap.join("vm.mem");
    let sock = dir.path().join("lazy.sock");
    let h = Handler::lazy(&image, &sock, &["--prefetch", "none", "--no-cache"]);
    for bad in ["65536", "1073741824"] {
        // The guest's faults are never served: it gives up after its timeout.
        let r = fake_vmm_within(&sock, &mem, 3, &["--handshake-page-size", bad, "--touch", "0"]);
        assert_eq!((r.code, r.json["stalled"].as_bool()), (3, Some(true)), "{bad}: {r:?}");
        let log = h.log_text();
        assert!(log.contains(&format!("page size {bad} is not served (only 4096")), "{bad}: the reason is logged: {log}");
    }
    assert!(h.reports(0, Duration::from_secs(1)).is_empty(), "no connection was served");
    let r = fake_vmm(&sock, &mem, &["--touch", "0-511"]);
    assert_clean(&r, 512);
}

/// A working set recorded on 4 KiB pages, replayed into a guest on 2 MiB pages (the same
/// image, restored with huge pages): the replay installs each touched huge page whole
/// from verified chunks, never a slice into a huge page; the guest reads every byte right.
#[test]
fn working_set_recorded_on_small_pages_replays_into_huge_pages() {
    if !uffd_usable() || !lazy_available() {
        return;
    }
    let Some(_reserved) = HugePages::reserve(8) else { return };
    let dir = tempfile::tempdir().unwrap();
    let (snap, image) = packed_sample(dir.path(), "16MiB", "29");
    let mem = snap.join("vm.mem");
    let zero = huge_pages_zero(&mem);
    let data: Vec<u64> = (0..zero.len() as u64).filter(|&h| !zero[h as usize]).take(3).collect();
    let pages: Vec<u64> = data.iter().flat_map(|h| [h * PER_HUGE + 10, h * PER_HUGE + 400]).collect();
    let list = pages.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
    let touch = ["--threads", "1", "--touch", &list];

    let sock = dir.path().join("rec.sock");
    let mut h = Handler::lazy(&image, &sock, &["--once", "--record-trace", "--prefetch", "none", "--no-cache"]);
    assert_clean(&fake_vmm(&sock, &mem, &touch), pages.len() as u64);
    assert_eq!(h.wait_exit(Duration::from_secs(30)), 0, "{}", h.log_text());
    assert!(n(&h.reports(1, Duration::from_secs(1))[0], &["working_set_recorded"]) > 0, "a working set was recorded");

    let sock = dir.path().join("replay.sock");
    let mut h = Handler::lazy(&image, &sock, &["--once", "--no-cache"]);
    // The guest waits before its first touch, so the replay (which starts after the
    // handshake) installs the huge pages first: otherwise the guest's faults may fetch
    // them before the replay reaches them, and the replay has nothing left to install.
    let mut vmm = vec!["--page-size", "2MiB", "--pause-ms", "2000"];
    vmm.extend_from_slice(&touch);
    assert_clean(&fake_vmm(&sock, &mem, &vmm), pages.len() as u64);
    assert_eq!(h.wait_exit(Duration::from_secs(30)), 0, "{}", h.log_text());
    let rep = &h.reports(1, Duration::from_secs(1))[0];
    assert_eq!(n(rep, &["working_set_slices"]), 0, "no slice is installed into a huge page: {rep}");
    assert!(n(rep, &["prefetched_bytes"]) >= HUGE, "the replay installed whole huge pages: {rep}");
    assert_eq!((n(rep, &["verify_failures"]), n(rep, &["poisoned_pages"])), (0, 0), "{rep}");
}
