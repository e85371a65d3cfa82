//! Names the source commit in the binary (`SNAPCTL_COMMIT`, for `snapctl_build_info`):
//! `git rev-parse HEAD` of the tree being built, or `SNAPCTL_COMMIT` when set (a build from
//! a source archive), else `unknown`.

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned()).filter(|s| !s.is_empty())
}

fn main() {
    println!("cargo:rerun-if-env-changed=SNAPCTL_COMMIT");
    let commit = std::env::var("SNAPCTL_COMMIT").ok().filter(|s| !s.is_empty()).or_else(|| git(&["rev-parse", "--short=12", "HEAD"]));
    // Rebuild when HEAD moves: HEAD itself (a checkout) and the branch it names (a commit).
    for path in [git(&["rev-parse", "--git-path", "HEAD"]), git(&["symbolic-ref", "-q", "HEAD"]).and_then(|r| git(&["rev-parse", "--git-path", &r]))]
        .into_iter()
        .flatten()
    {
        println!("cargo:rerun-if-changed={path}");
    }
    println!("cargo:rustc-env=SNAPCTL_COMMIT={}", commit.as_deref().unwrap_or("unknown"));
}
