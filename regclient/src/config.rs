//! Where the client keeps things on the user's machine: credentials as Docker keeps them
//! (`config.json`, shared with docker, skopeo, oras, crane, and the credential helpers it
//! names), and snapctl's cache directory (upload resume state, which repositories hold
//! which blobs).
//!
//! For a host, as docker does: the helper `credHelpers[HOST]`, else `credsStore`, is asked
//! first (see `helper.rs`); then `auths[HOST]` in the file (`identitytoken`, or `auth` =
//! base64 `user:password`, or `username` + `password`). docker stops at a configured
//! helper; snapctl also reads the file when the helper has nothing, where logins made
//! before a helper was configured left their entries.

use std::path::{Path, PathBuf};

use super::helper::Helper;
use super::{Credentials, CredentialsError};

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

/// The server name docker files a host's credentials under: Docker Hub's historical
/// `https://index.docker.io/v1/` for its hosts, else the host itself.
fn server_key(host: &str) -> &str {
    match host {
        "docker.io" | "index.docker.io" | "registry-1.docker.io" => "https://index.docker.io/v1/",
        h => h,
    }
}

/// The credential helper the config names for `host`: `credHelpers[host]`, else
/// `credsStore` (an empty name is none, as docker reads it).
fn configured_helper(cfg: &serde_json::Map<String, serde_json::Value>, host: &str, path: &Path) -> Option<Helper> {
    let named = |v: Option<&serde_json::Value>| v.and_then(|v| v.as_str()).filter(|n| !n.is_empty()).map(str::to_string);
    let helpers = cfg.get("credHelpers").and_then(|h| h.as_object());
    let per_host = [host, server_key(host)].into_iter().find_map(|k| named(helpers.and_then(|h| h.get(k))).map(|n| (n, format!("credHelpers[{k:?}]"))));
    let (name, origin) = per_host.or_else(|| named(cfg.get("credsStore")).map(|n| (n, "credsStore".to_string())))?;
    Some(Helper { name, origin, config: path.to_path_buf() })
}

/// The keys `auths` may hold `host` under: docker's key, the host, and `https://host`.
fn auths_keys(host: &str) -> [String; 3] {
    [server_key(host).to_string(), host.to_string(), format!("https://{host}")]
}

/// Credentials for `host` from `auths` in the file itself.
fn file_credentials(cfg: &serde_json::Map<String, serde_json::Value>, host: &str) -> Option<Credentials> {
    use base64::Engine;
    let auths = cfg.get("auths")?.as_object()?;
    let entry = auths_keys(host).iter().find_map(|k| auths.get(k))?;
    let field = |k: &str| entry.get(k).and_then(|v| v.as_str()).filter(|v| !v.is_empty());
    // docker's token flow uses an identity token in preference to a password.
    if let Some(t) = field("identitytoken") {
        return Some(Credentials::IdentityToken(t.into()));
    }
    if let (Some(u), Some(p)) = (field("username"), field("password")) {
        return Some(Credentials::Password { username: u.into(), password: p.into() });
    }
    let decoded = base64::engine::general_purpose::STANDARD.decode(field("auth")?).ok()?;
    let s = String::from_utf8(decoded).ok()?;
    let (u, p) = s.split_once(':')?;
    Some(Credentials::Password { username: u.into(), password: p.into() })
}

/// Credentials for `host` from Docker's config and the credential helper it names;
/// `Ok(None)` when there are none (anonymous access). A helper that fails (other than
/// "credentials not found") is an error; a config file that cannot be read is reported
/// with a warning and read as empty, as docker does.
pub fn docker_config_credentials(host: &str) -> Result<Option<Credentials>, CredentialsError> {
    match docker_config_path() {
        Some(path) => credentials_in(&path, host),
        None => Ok(None),
    }
}

/// [`docker_config_credentials`] from the config file at `path`.
fn credentials_in(path: &Path, host: &str) -> Result<Option<Credentials>, CredentialsError> {
    let cfg = match read_config(path) {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!("{}: {e}; no credentials read from it", path.display());
            return Ok(None);
        }
    };
    if let Some(helper) = configured_helper(&cfg, host, path) {
        if let Some(c) = helper.get(server_key(host))? {
            return Ok(Some(c));
        }
    }
    Ok(file_credentials(&cfg, host))
}

/// Where [`store_docker_credentials`] put the credentials.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Stored {
    /// In the config file itself (base64, not encrypted).
    File,
    /// In the keychain of this credential helper (`docker-credential-NAME`).
    Helper(String),
}

/// Store credentials for `host` as docker does. With a credential helper configured for
/// it (`credHelpers`, `credsStore`), through the helper (`store`), and the file keeps an
/// empty `auths[host]` entry (docker lists logins from it) and loses any secret an earlier
/// login left there. Otherwise in the file: `auths[host].auth`, every other key kept.
/// The file is replaced atomically (temp file, fsync, rename) with mode 0600.
pub fn store_docker_credentials(path: &Path, host: &str, creds: &Credentials) -> Result<Stored, CredentialsError> {
    use base64::Engine;
    let io = |source| CredentialsError::Config { path: path.to_path_buf(), source };
    let mut cfg = read_config(path).map_err(io)?;
    let helper = configured_helper(&cfg, host, path);
    if let Some(h) = &helper {
        h.store(server_key(host), creds)?;
    }
    let auths = cfg.entry("auths").or_insert_with(|| serde_json::json!({}));
    let Some(auths) = auths.as_object_mut() else {
        return Err(io(std::io::Error::other("\"auths\" is not an object")));
    };
    // Keep other keys of the host's entry (docker writes e.g. "email" there).
    let entry = auths.entry(host.to_string()).or_insert_with(|| serde_json::json!({}));
    if !entry.is_object() {
        *entry = serde_json::json!({});
    }
    let e = entry.as_object_mut().expect("an object");
    for k in ["auth", "username", "password", "identitytoken"] {
        e.remove(k);
    }
    if helper.is_none() {
        match creds {
            Credentials::Password { username, password } => {
                e.insert("auth".into(), base64::engine::general_purpose::STANDARD.encode(format!("{username}:{password}")).into());
            }
            Credentials::IdentityToken(t) => {
                e.insert("identitytoken".into(), t.clone().into());
            }
        }
    }
    write_private(path, &serde_json::to_vec_pretty(&cfg).expect("serializes")).map_err(io)?;
    Ok(match helper {
        Some(h) => Stored::Helper(h.name),
        None => Stored::File,
    })
}

/// Remove `host`'s credentials: from the credential helper configured for it (`erase`) and
/// from the file (every spelling of the host); `Ok(false)` when there were none.
pub fn remove_docker_credentials(path: &Path, host: &str) -> Result<bool, CredentialsError> {
    let io = |source| CredentialsError::Config { path: path.to_path_buf(), source };
    let mut cfg = read_config(path).map_err(io)?;
    let erased = match configured_helper(&cfg, host, path) {
        Some(h) => h.erase(server_key(host))?,
        None => false,
    };
    let removed = match cfg.get_mut("auths").and_then(|a| a.as_object_mut()) {
        Some(a) => auths_keys(host).iter().fold(false, |any, k| a.remove(k).is_some() | any),
        None => false,
    };
    if removed {
        write_private(path, &serde_json::to_vec_pretty(&cfg).expect("serializes")).map_err(io)?;
    }
    Ok(erased || removed)
}

/// Write a small file atomically with mode 0600 (created that way: never readable by
/// others, not even between create and chmod).
pub(crate) fn write_private(path: &Path, data: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    imgfmt::layout::write_atomic_mode(path, data, 0o600)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn password(c: Option<Credentials>) -> (String, String) {
        match c {
            Some(Credentials::Password { username, password }) => (username, password),
            other => panic!("expected a password, got {other:?}"),
        }
    }

    #[test]
    fn store_keeps_other_keys_and_is_private() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("config.json");
        std::fs::write(&p, r#"{"auths":{"other.io":{"auth":"eDp5"},"127.0.0.1:5000":{"email":"a@b","identitytoken":"old"}},"credsStore":"","x":[1]}"#).unwrap();
        let c = Credentials::Password { username: "al:ice".into(), password: "p:w".into() };
        assert_eq!(store_docker_credentials(&p, "127.0.0.1:5000", &c).unwrap(), Stored::File);
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
        assert_eq!(v["credsStore"], "");
        assert_eq!(v["x"][0], 1);
        assert_eq!(v["auths"]["other.io"]["auth"], "eDp5");
        assert_eq!(v["auths"]["127.0.0.1:5000"]["email"], "a@b", "other keys of the entry kept");
        assert!(v["auths"]["127.0.0.1:5000"].get("identitytoken").is_none(), "the old secret is replaced");
        assert_eq!(std::fs::metadata(&p).unwrap().permissions().mode() & 0o777, 0o600);
        // Read back through the lookup (a password with ':' survives: split at the first).
        assert_eq!(password(credentials_in(&p, "127.0.0.1:5000").unwrap()), ("al".into(), "ice:p:w".into()));
        assert!(remove_docker_credentials(&p, "127.0.0.1:5000").unwrap());
        assert!(!remove_docker_credentials(&p, "127.0.0.1:5000").unwrap());
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
        assert!(v["auths"].get("127.0.0.1:5000").is_none());
        assert_eq!(v["auths"]["other.io"]["auth"], "eDp5");
        assert!(credentials_in(&p, "127.0.0.1:5000").unwrap().is_none());
    }

    #[test]
    fn every_spelling_of_a_file_entry() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("config.json");
        std::fs::write(
            &p,
            r#"{"auths":{
                "a.io":{"auth":"YWxpY2U6cHc="},
                "https://b.io":{"username":"bob","password":"pw2"},
                "c.io":{"auth":"YWxpY2U6cHc=","identitytoken":"refresh-c"},
                "https://index.docker.io/v1/":{"identitytoken":"hub"}}}"#,
        )
        .unwrap();
        assert_eq!(password(credentials_in(&p, "a.io").unwrap()), ("alice".into(), "pw".into()));
        assert_eq!(password(credentials_in(&p, "b.io").unwrap()), ("bob".into(), "pw2".into()));
        // An identity token is used in preference to a password, as docker does.
        assert!(matches!(credentials_in(&p, "c.io").unwrap(), Some(Credentials::IdentityToken(t)) if t == "refresh-c"));
        assert!(matches!(credentials_in(&p, "registry-1.docker.io").unwrap(), Some(Credentials::IdentityToken(t)) if t == "hub"));
        assert!(credentials_in(&p, "d.io").unwrap().is_none());
        // A file that is not JSON gives no credentials (and a warning), not an error.
        std::fs::write(&p, "{not json").unwrap();
        assert!(credentials_in(&p, "a.io").unwrap().is_none());
    }

    #[test]
    fn per_host_helpers_win_over_the_store() {
        let p = Path::new("/c/config.json");
        let cfg = |j: &str| serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(j).unwrap();
        let c = cfg(r#"{"credsStore":"desktop","credHelpers":{"ghcr.io":"gh","https://index.docker.io/v1/":"hub"}}"#);
        assert_eq!(configured_helper(&c, "ghcr.io", p).unwrap().name, "gh");
        assert_eq!(configured_helper(&c, "ghcr.io", p).unwrap().origin, r#"credHelpers["ghcr.io"]"#);
        assert_eq!(configured_helper(&c, "docker.io", p).unwrap().name, "hub");
        let other = configured_helper(&c, "quay.io", p).unwrap();
        assert_eq!((other.name.as_str(), other.origin.as_str()), ("desktop", "credsStore"));
        assert!(configured_helper(&cfg(r#"{"credsStore":""}"#), "quay.io", p).is_none(), "an empty store is none");
        assert!(configured_helper(&cfg(r#"{"credHelpers":{"quay.io":""}}"#), "quay.io", p).is_none());
    }

    /// With a credential store configured, login stores through it and never falls back to
    /// a plaintext password in the file: a store that fails leaves the file as it was.
    #[test]
    fn a_failing_store_writes_no_password() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("config.json");
        let before = r#"{"credsStore":"snapctl-surely-not-installed"}"#;
        std::fs::write(&p, before).unwrap();
        let c = Credentials::Password { username: "u".into(), password: "secret".into() };
        let e = store_docker_credentials(&p, "r.io", &c).unwrap_err();
        assert!(matches!(e, CredentialsError::HelperNotRun { .. }), "{e}");
        assert_eq!(std::fs::read_to_string(&p).unwrap(), before);
        // Lookups and logout say what is wrong too.
        assert!(matches!(credentials_in(&p, "r.io"), Err(CredentialsError::HelperNotRun { .. })));
        assert!(remove_docker_credentials(&p, "r.io").is_err());
    }

    #[test]
    fn refuses_to_clobber_a_broken_config() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("config.json");
        std::fs::write(&p, "{not json").unwrap();
        let c = Credentials::Password { username: "u".into(), password: "p".into() };
        assert!(store_docker_credentials(&p, "h", &c).is_err());
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "{not json");
        // Missing file: created.
        let q = dir.path().join("sub").join("config.json");
        store_docker_credentials(&q, "h", &c).unwrap();
        assert!(q.is_file());
    }
}
