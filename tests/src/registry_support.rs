//! Support for the registry integration tests: a `snapctl serve` process guard, an S3
//! server guard (moto), OCI image layouts with random layers, bcrypt htpasswd files.

use std::io::Read;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sha2::{Digest as _, Sha256};

use std::fs;

use crate::{free_port, snapctl};

/// Wait until something accepts TCP connections on 127.0.0.1:`port`.
pub fn wait_for_port(port: u16, child: &mut Child, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return;
        }
        if let Ok(Some(st)) = child.try_wait() {
            let mut err = String::new();
            if let Some(e) = child.stderr.as_mut() {
                let _ = e.read_to_string(&mut err);
            }
            panic!("{what} exited with {st} before listening: {err}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("{what} did not listen on 127.0.0.1:{port} within 30 s");
}

/// A running `snapctl serve`; killed (SIGKILL) on drop.
pub struct Serve {
    /// The process.
    pub child: Child,
    /// 127.0.0.1:port
    pub addr: String,
    /// Where its stderr goes.
    pub log: PathBuf,
}

impl Serve {
    /// Start `snapctl serve --storage <storage> --listen 127.0.0.1:<free> <extra...>`.
    pub fn start(storage: &str, extra: &[&str], env: &[(&str, &str)]) -> Serve {
        let port = free_port();
        let addr = format!("127.0.0.1:{port}");
        let log = std::env::temp_dir().join(format!("snapctl-serve-{port}.log"));
        let mut cmd = snapctl();
        cmd.args(["serve", "--storage", storage, "--listen", &addr]).args(extra);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.stdout(Stdio::null()).stderr(std::fs::File::create(&log).expect("log file")).spawn().expect("spawn snapctl serve");
        let mut s = Serve { child, addr, log };
        wait_for_port(port, &mut s.child, "snapctl serve");
        s
    }

    /// `http://127.0.0.1:port` + path.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// SIGKILL and reap.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM; returns the exit status once the process has finished.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        // SAFETY: kill(2) on our own child's pid; no memory is involved.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        self.child.wait().expect("wait for snapctl serve")
    }

    /// The server's log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Peak RSS (VmHWM) in KiB, from /proc.
    pub fn peak_rss_kib(&self) -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap_or_default();
        s.lines().find_map(|l| l.strip_prefix("VmHWM:")).and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok()).unwrap_or(0)
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        self.kill9();
        if !std::thread::panicking() {
            let _ = std::fs::remove_file(&self.log);
        } else {
            eprintln!("snapctl serve log kept at {}", self.log.display());
        }
    }
}

/// An S3-compatible server on 127.0.0.1 (moto, or s3s-fs); killed on drop. `None`
/// (after a loud skip) when neither is installed. `SNAPCTL_S3_SERVER=moto|s3s-fs` picks
/// one; by default moto if present, else s3s-fs.
pub struct S3Server {
    child: Child,
    /// http://127.0.0.1:port
    pub endpoint: String,
    _root: Option<tempfile::TempDir>,
}

impl S3Server {
    /// Start a server and create `bucket`.
    pub fn start(bucket: &str) -> Option<S3Server> {
        let want = std::env::var("SNAPCTL_S3_SERVER").unwrap_or_default();
        let quiet_have = |p: &str| Command::new("sh").arg("-c").arg(format!("command -v {p} >/dev/null 2>&1")).status().is_ok_and(|s| s.success());
        let kind = match want.as_str() {
            "s3s-fs" => "s3s-fs",
            "moto" => "moto_server",
            _ if !quiet_have("moto_server") && quiet_have("s3s-fs") => "s3s-fs",
            _ => "moto_server",
        };
        if !crate::have(kind) {
            return None;
        }
        let port = free_port();
        let endpoint = format!("http://127.0.0.1:{port}");
        if kind == "s3s-fs" {
            let root = tempfile::tempdir().expect("tempdir");
            // s3s-fs buckets are directories of its root.
            std::fs::create_dir_all(root.path().join(bucket)).unwrap();
            let mut child = Command::new("s3s-fs")
                .args(["--host", "127.0.0.1", "--port", &port.to_string(), "--access-key", "test", "--secret-key", "test"])
                .arg(root.path())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("spawn s3s-fs");
            wait_for_port(port, &mut child, "s3s-fs");
            return Some(S3Server { child, endpoint, _root: Some(root) });
        }
        let mut child = Command::new("moto_server")
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn moto_server");
        wait_for_port(port, &mut child, "moto_server");
        let s = S3Server { child, endpoint, _root: None };
        // moto accepts unsigned bucket creation.
        let r = reqwest::blocking::Client::new().put(format!("{}/{bucket}", s.endpoint)).send().expect("create bucket");
        assert!(r.status().is_success(), "create bucket: {}", r.status());
        Some(s)
    }

    /// Environment for `snapctl serve --storage s3://...` against this server.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ENDPOINT_URL", self.endpoint.clone()),
            ("AWS_ACCESS_KEY_ID", "test".into()),
            ("AWS_SECRET_ACCESS_KEY", "test".into()),
            ("AWS_REGION", "us-east-1".into()),
            ("AWS_ALLOW_HTTP", "true".into()),
        ]
    }

    /// Same, as `object_store` config overrides.
    pub fn overrides(&self) -> Vec<(&'static str, String)> {
        vec![
            ("aws_endpoint", self.endpoint.clone()),
            ("aws_access_key_id", "test".into()),
            ("aws_secret_access_key", "test".into()),
            ("aws_region", "us-east-1".into()),
            ("aws_allow_http", "true".into()),
        ]
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Deterministic pseudo-random bytes (xorshift64*), fast enough for hundreds of MiB.
pub fn random_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        out.extend_from_slice(&x.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// `sha256:<hex>` of bytes.
pub fn sha256(data: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(data)))
}

/// An OCI image layout at `dir` holding one manifest tagged `tag`, with an
/// `artifactType` and custom media types like a snapctl snapshot, a small config, and
/// one layer of `layer_len` random bytes per entry of `layers` (value = seed).
/// Returns the manifest digest.
pub fn oci_layout(dir: &Path, tag: &str, layers: &[(u64, usize)]) -> String {
    let blobs = dir.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).unwrap();
    let put = |data: &[u8]| -> (String, usize) {
        let d = sha256(data);
        std::fs::write(blobs.join(&d[7..]), data).unwrap();
        (d, data.len())
    };
    let (cd, cl) = put(br#"{"snapctl":"test config"}"#);
    let layer_descs: Vec<serde_json::Value> = layers
        .iter()
        .map(|&(seed, len)| {
            let (d, n) = put(&random_bytes(seed, len));
            serde_json::json!({"mediaType": "application/vnd.snapctl.pack.v1", "digest": d, "size": n})
        })
        .collect();
    let m = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "artifactType": "application/vnd.snapctl.snapshot.v1",
        "config": {"mediaType": "application/vnd.snapctl.config.v1+json", "digest": cd, "size": cl},
        "layers": layer_descs,
    });
    let mb = serde_json::to_vec(&m).unwrap();
    let (md, ml) = put(&mb);
    let index = serde_json::json!({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": md, "size": ml,
        "annotations": {"org.opencontainers.image.ref.name": tag}}]});
    std::fs::write(dir.join("index.json"), serde_json::to_vec(&index).unwrap()).unwrap();
    std::fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
    md
}

/// The digest of the manifest tagged `tag` in an OCI layout's index.json.
pub fn layout_manifest_digest(dir: &Path, tag: &str) -> Option<String> {
    let index: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("index.json")).ok()?).ok()?;
    index["manifests"].as_array()?.iter().find_map(|m| {
        let t = m["annotations"]["org.opencontainers.image.ref.name"].as_str()?;
        (t == tag).then(|| m["digest"].as_str().map(str::to_owned)).flatten()
    })
}

/// Write an htpasswd file with bcrypt (cost 4: tests only) entries for `users`.
pub fn htpasswd(path: &Path, users: &[(&str, &str)]) {
    let text: String = users.iter().map(|(u, p)| format!("{u}:{}\n", bcrypt::hash(p, 4).expect("bcrypt"))).collect();
    std::fs::write(path, text).unwrap();
}

/// Debian's `docker-registry` (distribution 2.8: no referrers API) on a free loopback port.
pub struct Distribution {
    child: Child,
    /// `127.0.0.1:PORT`.
    pub addr: String,
}

impl Distribution {
    /// Start `docker-registry` with its storage under `dir`, deletes enabled.
    pub fn start(dir: &Path) -> Distribution {
        Distribution::start_with(dir, true)
    }

    /// [`Distribution::start`] with deletes disabled (distribution's default: DELETE is
    /// answered 405 UNSUPPORTED).
    pub fn start_without_delete(dir: &Path) -> Distribution {
        Distribution::start_with(dir, false)
    }

    fn start_with(dir: &Path, delete: bool) -> Distribution {
        fs::create_dir_all(dir).unwrap();
        let port = free_port();
        let addr = format!("127.0.0.1:{port}");
        let cfg = dir.join("config.yml");
        fs::write(
            &cfg,
            format!(
                "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: {delete}\nhttp:\n  addr: {addr}\n",
                dir.join("data").display()
            ),
        )
        .unwrap();
        let mut child =
            Command::new("docker-registry").arg("serve").arg(&cfg).stdout(Stdio::null()).stderr(Stdio::null()).spawn().expect("spawn docker-registry");
        wait_for_port(port, &mut child, "docker-registry");
        Distribution { child, addr }
    }
}

impl Drop for Distribution {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A certificate authority and a server certificate it signed for 127.0.0.1 and
/// localhost, made by `openssl` in a temporary directory (what `snapctl serve --tls-cert`
/// is given in a test; the client trusts it by `--ca-file ca`).
pub struct TestCa {
    _dir: tempfile::TempDir,
    /// The CA's certificate (PEM).
    pub ca: PathBuf,
    /// The server's certificate (PEM), signed by the CA.
    pub cert: PathBuf,
    /// The server's private key (PEM).
    pub key: PathBuf,
}

impl TestCa {
    /// `None` (after a loud skip, or a failure under `SNAPCTL_REQUIRE_PEERS=1`) without
    /// `openssl`.
    pub fn make() -> Option<TestCa> {
        if !crate::have("openssl") {
            return None;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let p = |n: &str| dir.path().join(n);
        fs::write(p("ext"), "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n").unwrap();
        let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
        let steps: [Vec<&str>; 3] = [
            [&["req", "-x509"][..], &ec, &["-days", "2", "-subj", "/CN=snapctl-test-ca", "-addext", "basicConstraints=critical,CA:TRUE"]].concat(),
            [&["req"][..], &ec, &["-subj", "/CN=127.0.0.1"]].concat(),
            vec!["x509", "-req", "-days", "2", "-CAcreateserial"],
        ];
        let files: [&[(&str, &str)]; 3] = [
            &[("-keyout", "ca.key"), ("-out", "ca.pem")],
            &[("-keyout", "key.pem"), ("-out", "req.csr")],
            &[("-in", "req.csr"), ("-CA", "ca.pem"), ("-CAkey", "ca.key"), ("-extfile", "ext"), ("-out", "cert.pem")],
        ];
        for (args, files) in steps.iter().zip(files) {
            let mut c = Command::new("openssl");
            c.args(args);
            for (flag, name) in files {
                c.arg(flag).arg(p(name));
            }
            let out = c.output().expect("run openssl");
            assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        }
        Some(TestCa { ca: p("ca.pem"), cert: p("cert.pem"), key: p("key.pem"), _dir: dir })
    }
}
