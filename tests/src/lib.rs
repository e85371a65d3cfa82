//! Support for snapctl's cross-crate integration tests (`tests/tests/it/`): finding the
//! `snapctl` binary, generating sample snapshots, starting real peers on 127.0.0.1.
//!
//! All integration tests live in one test binary (`tests/tests/it/main.rs`) so the
//! workspace links them once.

pub mod fault_proxy;
pub mod registry_support;

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
        cmd.current_dir(workspace_root())
            .args(["build", "--quiet", "-p", "snapctl", "--bin", "snapctl"])
            .arg("--target-dir")
            .arg(&target_dir);
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
    c.env_remove("SNAPCTL_LOG").env("NO_COLOR", "1");
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

/// A free TCP port on 127.0.0.1 (bound then released; good enough for tests that
/// start a server right away).
pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    l.local_addr().expect("local_addr").port()
}

/// Whether an external program is on PATH (tests that need a real peer skip loudly
/// without it, unless `SNAPCTL_REQUIRE_PEERS=1`, which CI sets, turns that into a failure).
pub fn have(program: &str) -> bool {
    let found = Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {program} >/dev/null 2>&1"))
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !found && std::env::var_os("SNAPCTL_REQUIRE_PEERS").is_some_and(|v| v == "1") {
        panic!("{program} is required (SNAPCTL_REQUIRE_PEERS=1) but not on PATH; run scripts/setup.sh");
    }
    if !found {
        eprintln!("SKIP: {program} not on PATH");
    }
    found
}
