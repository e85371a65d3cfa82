//! The checkpoint/restore test program `tests/runtimes/counter.c` (gVisor and CRIU round
//! trips): building it, and reading the progress lines it appends every 100 ms.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::{run, workspace_root};

/// One progress line: `count=<n> sum0=<checksum at start> sum=<checksum now> pid=<pid>`.
#[derive(Debug, Clone, PartialEq)]
pub struct Tick {
    pub count: u64,
    pub sum0: String,
    pub sum: String,
}

/// Build the counter static (it runs inside a gVisor sandbox, and CRIU restores it on its
/// own) into `dir/counter`; `Err` carries gcc's output.
pub fn build(dir: &Path) -> Result<PathBuf, String> {
    let counter = dir.join("counter");
    let r = run(Command::new("gcc").args(["-O2", "-static", "-o"]).arg(&counter).arg(workspace_root().join("tests/runtimes/counter.c")));
    if r.code != 0 {
        return Err(format!("gcc -static failed (libc6-dev missing?): {}", r.stderr));
    }
    Ok(counter)
}

/// Every complete tick in the progress file so far.
pub fn ticks(progress: &Path) -> Vec<Tick> {
    let text = std::fs::read_to_string(progress).unwrap_or_default();
    text.lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace().map(|kv| kv.split_once('=').map(|(_, v)| v.to_string()));
            let count = f.next()??.parse().ok()?;
            Some(Tick { count, sum0: f.next()??, sum: f.next()?? })
        })
        .collect()
}

/// Wait (30 s at most, then fail naming `what`) for a tick with `count >= want`.
pub fn wait_for_count(progress: &Path, want: u64, what: &str) -> Tick {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(t) = ticks(progress).into_iter().rev().find(|t| t.count >= want) {
            return t;
        }
        assert!(Instant::now() < deadline, "{what}: no count >= {want} within 30 s; ticks: {:?}", ticks(progress));
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Check that a restored counter continued from `at_checkpoint` rather than starting over,
/// and that its heap came back intact: the ticks written after the first `earlier` lines of
/// `progress` (lines the program wrote before its checkpoint, when it writes to the same
/// file after restore) count on past the checkpoint, with the same start checksum (the
/// same program instance) and a heap checksum that still matches it.
pub fn assert_continued(progress: &Path, earlier: usize, at_checkpoint: &Tick, what: &str) {
    let after = wait_for_count(progress, at_checkpoint.count + 3, what);
    let restored = ticks(progress).split_off(earlier);
    let first = restored.first().expect("a tick after restore");
    assert!(
        first.count > at_checkpoint.count,
        "{what}: the restored counter started at {} (checkpoint was at {}): it began again instead of continuing",
        first.count,
        at_checkpoint.count
    );
    assert_eq!(after.sum0, at_checkpoint.sum0, "{what}: a different program instance (heap seed changed)");
    for t in &restored {
        assert_eq!(t.sum, t.sum0, "{what}: heap checksum after restore no longer matches at count {}", t.count);
    }
}

/// SHA-256 of a file, hex.
pub fn sha256_file(p: &Path) -> String {
    use sha2::Digest as _;
    let mut h = sha2::Sha256::new();
    std::io::copy(&mut std::fs::File::open(p).unwrap(), &mut h).unwrap();
    hex::encode(h.finalize())
}
