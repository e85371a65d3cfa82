//! Support for snapctl's cross-crate integration tests (`tests/tests/it/`): finding the
//! `snapctl` binary, a work area per test ([`Work`]), generating sample snapshots,
//! starting real peers on 127.0.0.1.
//!
//! All integration tests live in one test binary (`tests/tests/it/main.rs`) so the
//! workspace links them once.

pub mod counter;
pub mod fault_proxy;
pub mod hostile;
pub mod netem;
mod proxy;
pub mod registry_support;
pub mod work;

pub use work::Work;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The workspace root (the directory holding the top-level `Cargo.toml`).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ has a parent").to_path_buf()
}

/// Path to a built `snapctl` binary.
///
/// `SNAPCTL_BIN` wins; otherwise the binary is built once per test run with the same
/// profile as the tests, so `cargo test` alone is enough.
pub fn snapctl_bin() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(p) = std::env::var_os("SNAPCTL_BIN") {
            return PathBuf::from(p);
        }
        // The test executable lives in target/<profile>/deps/; the binary in target/<profile>/.
        let exe = std::env::current_exe().expect("current_exe");
        let profile_dir = exe.parent().and_then(Path::parent).expect("target/<profile>").to_path_buf();
        let release = profile_dir.file_name().is_some_and(|n| n == "release");
        let target_dir = profile_dir.parent().expect("target dir").to_path_buf();
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.current_dir(workspace_root()).args(["build", "--quiet", "-p", "snapctl", "--bin", "snapctl"]).arg("--target-dir").arg(&target_dir);
        if release {
            cmd.arg("--release");
        }
        let status = cmd.status().expect("run cargo build for snapctl");
        assert!(status.success(), "building snapctl failed");
        profile_dir.join("snapctl")
    })
    .clone()
}

/// A `Command` for the snapctl binary with a clean, predictable environment.
pub fn snapctl() -> Command {
    let mut c = Command::new(snapctl_bin());
    c.env_remove("SNAPCTL_LOG").env_remove("RUST_LOG").env("NO_COLOR", "1");
    c
}

/// Output of a finished command, with both streams as text, for readable assertions.
#[derive(Debug)]
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

/// Run a command to completion and capture code and both streams.
pub fn run(cmd: &mut Command) -> Run {
    let out = cmd.output().expect("spawn");
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// splitmix64: a tiny deterministic generator for the test runtimes' data and touch
/// orders (same seed, same sequence; not for anything that needs real randomness).
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e3779b97f4a7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
        z ^ (z >> 31)
    }

    /// Fisher–Yates.
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = (self.next_u64() % (i as u64 + 1)) as usize;
            v.swap(i, j);
        }
    }
}

/// Flip one bit (0x40) of the first stored chunk of `file` where its pack holds it, 100
/// bytes into the chunk's stored bytes, in the OCI layout at `layout_dir` (image `tag`):
/// a tampered pack for the verification tests. Returns that chunk's index in the file.
pub fn tamper_first_stored_chunk(layout_dir: &Path, tag: &str, file: &str) -> u64 {
    use imgfmt::BlobSource;
    use std::os::unix::fs::FileExt;
    let layout = imgfmt::OciLayout::open(layout_dir).expect("layout");
    let image = imgfmt::Image::open(&layout, &layout.resolve_tag(tag).expect("tag")).expect("image");
    let entry = image.file(file).unwrap_or_else(|| panic!("{file} in the image")).1;
    let (chunk, pack, offset) = entry
        .chunks
        .iter()
        .enumerate()
        .find_map(|(i, c)| match c.at {
            imgfmt::StoredAt::Pack { pack, offset, .. } => Some((i as u64, pack, offset)),
            imgfmt::StoredAt::Zero => None,
        })
        .expect("a stored chunk");
    let digest = image.packs[pack as usize].digest.to_string();
    let blob = layout_dir.join("blobs/sha256").join(digest.trim_start_matches("sha256:"));
    let f = std::fs::OpenOptions::new().read(true).write(true).open(&blob).expect("pack blob");
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, offset + 100).expect("read pack");
    f.write_all_at(&[b[0] ^ 0x40], offset + 100).expect("write pack");
    chunk
}

/// A free TCP port on 127.0.0.1 (bound then released; good enough for tests that
/// start a server right away).
pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    l.local_addr().expect("local_addr").port()
}

/// Whether `SNAPCTL_REQUIRE_PEERS=1` (CI sets it): a test that would skip for want of a
/// peer or a kernel feature fails instead.
pub fn require_peers() -> bool {
    std::env::var_os("SNAPCTL_REQUIRE_PEERS").is_some_and(|v| v == "1")
}

/// Whether this process may create a userfaultfd that also handles kernel-mode faults (the
/// fake runtimes read their memory with process_vm_readv). Skips loudly, or fails under
/// [`require_peers`].
pub fn uffd_usable() -> bool {
    // SAFETY: the userfaultfd syscall with flags only; the fd is closed right away.
    let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK) };
    if fd >= 0 {
        // SAFETY: closing the fd we just created.
        unsafe { libc::close(fd as i32) };
        return true;
    }
    let e = std::io::Error::last_os_error();
    assert!(!require_peers(), "userfaultfd is required (SNAPCTL_REQUIRE_PEERS=1) but unavailable: {e}");
    eprintln!("SKIP: userfaultfd unavailable here ({e}); lazy-restore tests need root");
    false
}

/// Whether an external program is on PATH (tests that need a real peer skip loudly
/// without it, unless `SNAPCTL_REQUIRE_PEERS=1`, which CI sets, turns that into a failure).
pub fn have(program: &str) -> bool {
    let found = Command::new("sh").arg("-c").arg(format!("command -v {program} >/dev/null 2>&1")).status().map(|s| s.success()).unwrap_or(false);
    if !found && require_peers() {
        panic!("{program} is required (SNAPCTL_REQUIRE_PEERS=1) but not on PATH; run scripts/setup.sh");
    }
    if !found {
        eprintln!("SKIP: {program} not on PATH");
    }
    found
}

/// 2 MiB huge pages reserved for a test (`/proc/sys/vm/nr_hugepages` raised by `n`), given
/// back on drop. Reservations by tests running at once, in this process or another, add up:
/// each one adds its own and takes its own back under an exclusive lock of one file, so
/// the machine's count ends where it started whatever order they finish in.
pub struct HugePages {
    n: u64,
}

const NR_HUGEPAGES: &str = "/proc/sys/vm/nr_hugepages";
/// One lock for every process on the machine that changes the count this way.
const HUGEPAGES_LOCK: &str = "/tmp/snapctl-tests-hugepages.lock";

fn with_hugepages_lock<T>(f: impl FnOnce() -> std::io::Result<T>) -> std::io::Result<T> {
    use std::os::fd::AsRawFd;
    let lock = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(HUGEPAGES_LOCK)?;
    // SAFETY: flock on a descriptor we own; the lock goes with the descriptor at the end.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    f()
}

fn nr_hugepages() -> std::io::Result<u64> {
    std::fs::read_to_string(NR_HUGEPAGES)?.trim().parse().map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("{NR_HUGEPAGES}: {e}")))
}

impl HugePages {
    /// Reserve `n` more 2 MiB huge pages. `None` (after a loud skip, or a failure under
    /// [`require_peers`]) where the count cannot be raised (not root, no hugetlbfs) or the
    /// kernel found fewer free pages than asked (memory too fragmented).
    pub fn reserve(n: u64) -> Option<HugePages> {
        let got = with_hugepages_lock(|| {
            let before = nr_hugepages()?;
            std::fs::write(NR_HUGEPAGES, (before + n).to_string())?;
            let mut after = nr_hugepages()?;
            if after < before + n {
                // Free memory in 4 KiB pieces: compact it once and ask again.
                std::fs::write("/proc/sys/vm/compact_memory", "1")?;
                std::fs::write(NR_HUGEPAGES, (before + n).to_string())?;
                after = nr_hugepages()?;
            }
            if after < before + n {
                // Take back what was added: a test that cannot have them all runs none.
                std::fs::write(NR_HUGEPAGES, before.min(after).to_string())?;
                return Err(std::io::Error::other(format!("asked for {} huge pages, the kernel made {after}", before + n)));
            }
            Ok(())
        });
        match got {
            Ok(()) => Some(HugePages { n }),
            Err(e) => {
                assert!(!require_peers(), "{n} huge pages of 2 MiB are required (SNAPCTL_REQUIRE_PEERS=1) but could not be reserved: {e}");
                eprintln!("SKIP: {n} huge pages of 2 MiB could not be reserved ({e}); huge-page tests need root");
                None
            }
        }
    }
}

impl Drop for HugePages {
    fn drop(&mut self) {
        let r = with_hugepages_lock(|| {
            let now = nr_hugepages()?;
            std::fs::write(NR_HUGEPAGES, now.saturating_sub(self.n).to_string())
        });
        if let Err(e) = r {
            eprintln!("warning: could not give back {} huge pages ({NR_HUGEPAGES}): {e}", self.n);
        }
    }
}
