//! Names the commit `snapctl --version` and `snapctl_build_info` report: `SNAPCTL_COMMIT`
//! when the builder sets it (a build from a source archive), else
//! `git rev-parse --short=12 HEAD`, else `unknown` (no git, or not a checkout).

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok().filter(|o| o.status.success())?;
    let s = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (!s.is_empty()).then_some(s)
}

fn main() {
    println!("cargo:rerun-if-env-changed=SNAPCTL_COMMIT");
    let commit = std::env::var("SNAPCTL_COMMIT").ok().filter(|c| !c.trim().is_empty()).or_else(|| git(&["rev-parse", "--short=12", "HEAD"]));
    // Rebuilt when HEAD moves: the HEAD file, the branch it names, packed refs (paths of
    // this checkout, a worktree's included). Only files that exist: cargo reruns a build
    // script every time for a missing one.
    if commit.is_some() {
        let branch = git(&["symbolic-ref", "-q", "HEAD"]);
        for path in ["HEAD", "packed-refs"].into_iter().map(str::to_string).chain(branch) {
            if let Some(p) = git(&["rev-parse", "--path-format=absolute", "--git-path", &path]).filter(|p| std::path::Path::new(p).exists()) {
                println!("cargo:rerun-if-changed={p}");
            }
        }
    } else {
        println!("cargo:rerun-if-changed=build.rs");
    }
    println!("cargo:rustc-env=SNAPCTL_COMMIT={}", commit.as_deref().unwrap_or("unknown"));
}
