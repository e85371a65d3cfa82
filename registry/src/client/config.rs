//! Where the client keeps things on the user's machine: credentials in Docker's
//! `config.json` (shared with docker, skopeo, oras, crane), and snapctl's cache directory
//! (upload resume state, which repositories hold which blobs).

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use super::Credentials;

/// snapctl's per-user cache directory: `$SNAPCTL_CACHE`, else `$XDG_CACHE_HOME/snapctl`,
/// else `~/.cache/snapctl`, else a directory under the system temp dir.
pub fn cache_dir() -> PathBuf {
    if let Some(p) = std::env::var_os("SNAPCTL_CACHE").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    if let Some(p) = std::env::var_os("XDG_CACHE_HOME").filter(|p| !p.is_empty()) {
        return PathBuf::from(p).join("snapctl");
    }
    if let Some(h) = std::env::var_os("HOME").filter(|p| !p.is_empty()) {
        return PathBuf::from(h).join(".cache").join("snapctl");
    }
    std::env::temp_dir().join("snapctl-cache")
}

/// Docker's config file: `$DOCKER_CONFIG/config.json`, else `~/.docker/config.json`.
pub fn docker_config_path() -> Option<PathBuf> {
    std::env::var_os("DOCKER_CONFIG")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".docker")))
        .map(|d| d.join("config.json"))
}

/// Docker config files are small; a bigger one is not read (a bound, not a format rule).
const MAX_CONFIG_BYTES: u64 = 4 << 20;

fn read_config(path: &Path) -> std::io::Result<serde_json::Map<String, serde_json::Value>> {
    use std::io::Read;
    let f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Default::default()),
        Err(e) => return Err(e),
    };
    let mut b = Vec::new();
    f.take(MAX_CONFIG_BYTES + 1).read_to_end(&mut b)?;
    if b.len() as u64 > MAX_CONFIG_BYTES {
        return Err(std::io::Error::other(format!("larger than {MAX_CONFIG_BYTES} bytes")));
    }
    if b.iter().all(u8::is_ascii_whitespace) {
        return Ok(Default::default());
    }
    match serde_json::from_slice(&b) {
        Ok(serde_json::Value::Object(m)) => Ok(m),
        Ok(_) => Err(std::io::Error::other("not a JSON object")),
        Err(e) => Err(std::io::Error::other(format!("not JSON: {e}"))),
    }
}

/// Look up `host` in Docker's config (`auths.<host>.auth`, base64 `user:pass`; also the
/// `https://host` spelling docker writes for some registries).
pub fn docker_config_credentials(host: &str) -> Option<Credentials> {
    use base64::Engine;
    let cfg = read_config(&docker_config_path()?).ok()?;
    let auths = cfg.get("auths")?.as_object()?;
    let entry = auths.get(host).or_else(|| auths.get(&format!("https://{host}")))?;
    if let (Some(u), Some(p)) = (entry.get("username").and_then(|v| v.as_str()), entry.get("password").and_then(|v| v.as_str())) {
        return Some(Credentials { username: u.into(), password: p.into() });
    }
    let decoded = base64::engine::general_purpose::STANDARD.decode(entry.get("auth")?.as_str()?).ok()?;
    let s = String::from_utf8(decoded).ok()?;
    let (u, p) = s.split_once(':')?;
    Some(Credentials { username: u.into(), password: p.into() })
}

/// Store credentials for `host` in Docker's config, keeping every other key. The file is
/// replaced atomically (temp file, fsync, rename) and is mode 0600: it holds a password.
pub fn store_docker_credentials(path: &Path, host: &str, creds: &Credentials) -> std::io::Result<()> {
    use base64::Engine;
    let mut cfg = read_config(path)?;
    let auths = cfg.entry("auths").or_insert_with(|| serde_json::json!({}));
    let Some(auths) = auths.as_object_mut() else {
        return Err(std::io::Error::other("\"auths\" is not an object"));
    };
    let token = base64::engine::general_purpose::STANDARD.encode(format!("{}:{}", creds.username, creds.password));
    // Keep other keys of the host's entry (docker writes e.g. "identitytoken" there).
    let entry = auths.entry(host.to_string()).or_insert_with(|| serde_json::json!({}));
    match entry.as_object_mut() {
        Some(e) => {
            e.insert("auth".into(), token.into());
        }
        None => *entry = serde_json::json!({ "auth": token }),
    }
    write_private(path, &serde_json::to_vec_pretty(&cfg).expect("serializes"))
}

/// Remove `host` (both spellings) from Docker's config; `Ok(false)` when it was not there.
pub fn remove_docker_credentials(path: &Path, host: &str) -> std::io::Result<bool> {
    let mut cfg = read_config(path)?;
    let removed = match cfg.get_mut("auths").and_then(|a| a.as_object_mut()) {
        Some(a) => a.remove(host).is_some() | a.remove(&format!("https://{host}")).is_some(),
        None => false,
    };
    if removed {
        write_private(path, &serde_json::to_vec_pretty(&cfg).expect("serializes"))?;
    }
    Ok(removed)
}

/// Write a small file atomically with mode 0600 (created that way: never readable by
/// others, not even between create and chmod).
pub(crate) fn write_private(path: &Path, data: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let tmp = imgfmt::layout::tempname(dir, ".tmp-snapctl");
    let res = (|| {
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&tmp)?;
        f.write_all(data)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        std::fs::File::open(dir)?.sync_all()
    })();
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn store_keeps_other_keys_and_is_private() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("config.json");
        std::fs::write(&p, r#"{"auths":{"other.io":{"auth":"eDp5"}},"credsStore":"desktop","x":[1]}"#).unwrap();
        let c = Credentials { username: "al:ice".into(), password: "p:w".into() };
        store_docker_credentials(&p, "127.0.0.1:5000", &c).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
        assert_eq!(v["credsStore"], "desktop");
        assert_eq!(v["x"][0], 1);
        assert_eq!(v["auths"]["other.io"]["auth"], "eDp5");
        assert_eq!(std::fs::metadata(&p).unwrap().permissions().mode() & 0o777, 0o600);
        // Read back through the lookup (a password with ':' survives: split at the first).
        std::env::set_var("DOCKER_CONFIG", dir.path());
        let got = docker_config_credentials("127.0.0.1:5000").unwrap();
        assert_eq!((got.username.as_str(), got.password.as_str()), ("al", "ice:p:w"));
        std::env::remove_var("DOCKER_CONFIG");
        assert!(remove_docker_credentials(&p, "127.0.0.1:5000").unwrap());
        assert!(!remove_docker_credentials(&p, "127.0.0.1:5000").unwrap());
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
        assert!(v["auths"].get("127.0.0.1:5000").is_none());
        assert_eq!(v["auths"]["other.io"]["auth"], "eDp5");
    }

    #[test]
    fn refuses_to_clobber_a_broken_config() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("config.json");
        std::fs::write(&p, "{not json").unwrap();
        let c = Credentials { username: "u".into(), password: "p".into() };
        assert!(store_docker_credentials(&p, "h", &c).is_err());
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "{not json");
        // Missing file: created.
        let q = dir.path().join("sub").join("config.json");
        store_docker_credentials(&q, "h", &c).unwrap();
        assert!(q.is_file());
    }
}
