//! [`Work`]: a test's own temporary directory, and `snapctl` run against it with the cache
//! directory and the Docker config inside it, so no two tests share a cache or
//! credentials and none reads the user's. Steps only one test file takes stay in that
//! file (an extension trait over `Work` there).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::registry_support::Serve;
use crate::{run, snapctl, Run};

/// A temporary work area (removed on drop) and the commands run in it.
pub struct Work {
    dir: tempfile::TempDir,
    /// Set for every command, after the cache and Docker config ([`Work::with_env`]).
    env: Vec<(OsString, OsString)>,
    /// Commands run in the directory, with `HOME` set to it ([`Work::at_home`]).
    home: bool,
}

impl Default for Work {
    fn default() -> Work {
        Work::new()
    }
}

impl Work {
    pub fn new() -> Work {
        Work { dir: tempfile::tempdir().unwrap(), env: Vec::new(), home: false }
    }

    /// Every command also gets `key=value` in its environment.
    pub fn with_env(mut self, key: impl Into<OsString>, value: impl Into<OsString>) -> Work {
        self.env.push((key.into(), value.into()));
        self
    }

    /// Every command runs in the work directory with `HOME` set to it (relative paths,
    /// and files under `~`, land in the work area).
    pub fn at_home(mut self) -> Work {
        self.home = true;
        self
    }

    /// The work directory.
    pub fn root(&self) -> &Path {
        self.dir.path()
    }

    pub fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    /// [`Work::path`] as a string, for arguments.
    pub fn s(&self, p: &str) -> String {
        self.path(p).to_string_lossy().into_owned()
    }

    /// The cache directory every command is given (`$SNAPCTL_CACHE`).
    pub fn cache(&self) -> PathBuf {
        self.path("cache")
    }

    /// `snapctl` with this work area's cache and Docker config.
    pub fn cmd(&self) -> Command {
        let mut c = snapctl();
        c.env("SNAPCTL_CACHE", self.cache()).env("DOCKER_CONFIG", self.path("docker"));
        if self.home {
            c.env("HOME", self.root()).current_dir(self.root());
        }
        c.envs(self.env.iter().map(|(k, v)| (k, v)));
        c
    }

    pub fn run(&self, args: &[&str]) -> Run {
        run(self.cmd().args(args))
    }

    /// `snapctl ARGS`, which must exit 0.
    pub fn ok(&self, args: &[&str]) -> Run {
        let r = self.run(args);
        assert_eq!(r.code, 0, "snapctl {args:?}: {r:?}");
        r
    }

    /// `snapctl ARGS --json`, which must exit 0: the report and stderr.
    pub fn json(&self, args: &[&str]) -> (serde_json::Value, String) {
        let r = self.ok(&[args, &["--json"]].concat());
        (serde_json::from_str(&r.stdout).unwrap_or_else(|e| panic!("{args:?} --json ({e}): {}", r.stdout)), r.stderr)
    }

    /// Store `user:password` for `host` in this area's Docker config.
    pub fn credentials(&self, host: &str, user: &str, password: &str) {
        use base64::Engine;
        let auth = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
        std::fs::create_dir_all(self.path("docker")).unwrap();
        std::fs::write(self.path("docker/config.json"), format!(r#"{{"auths":{{"{host}":{{"auth":"{auth}"}}}}}}"#)).unwrap();
    }

    /// `snapctl sample` of `size` into the new directory `name`.
    pub fn sample(&self, name: &str, size: &str) -> PathBuf {
        self.sample_with(name, size, &[])
    }

    /// [`Work::sample`] with more `sample` flags (`--seed N`, `--zero-fraction 0`, ...).
    pub fn sample_with(&self, name: &str, size: &str, extra: &[&str]) -> PathBuf {
        let p = self.path(name);
        self.ok(&[&["sample", p.to_str().unwrap(), "--size", size][..], extra].concat());
        p
    }

    /// A `snapctl serve` (with `extra` flags) storing into the new directory `dir` here.
    pub fn serve(&self, dir: &str, extra: &[&str]) -> Serve {
        let storage = self.path(dir);
        std::fs::create_dir_all(&storage).unwrap();
        Serve::start(storage.to_str().unwrap(), extra, &[])
    }
}
