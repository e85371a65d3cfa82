//! Authentication and authorization.
//!
//! - Users: an htpasswd file of bcrypt hashes (`user:$2y$...`; other schemes refused).
//! - Rights: an ACL file (TOML, below) giving `pull`, `push` and `delete` per repository
//!   pattern; without one, any authenticated user may do anything and anonymous users
//!   may pull only if `anonymous_read` is set.
//! - Credentials: HTTP Basic on any request, or a Bearer token from `GET /token` (the
//!   docker token flow). Tokens are HS256 JWTs signed with a server secret; replicas that
//!   share a secret accept each other's tokens.
//!
//! ACL file:
//! ```toml
//! [[rule]]
//! users = ["alice", "bob"]     # user names; "*" = any authenticated user; "anonymous"
//! repos = ["team/*", "public"] # exact name, "prefix/*" (any depth below), or "*"
//! actions = ["pull", "push"]   # pull, push, delete
//! ```
//! A request is allowed if any rule grants the action.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::http::{header, HeaderMap};
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use base64::Engine as _;
use hmac::{Hmac, Mac};
use sha2::{Digest as _, Sha256};

/// How long an issued token is valid.
pub const TOKEN_TTL: Duration = Duration::from_secs(300);

/// Something a client may do to a repository.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    /// Read manifests, blobs, tags, referrers.
    Pull,
    /// Upload blobs, put manifests and tags.
    Push,
    /// Delete manifests, tags, blobs.
    Delete,
}

impl Action {
    /// Wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Pull => "pull",
            Action::Push => "push",
            Action::Delete => "delete",
        }
    }

    fn parse(s: &str) -> Option<Action> {
        match s {
            "pull" => Some(Action::Pull),
            "push" => Some(Action::Push),
            "delete" => Some(Action::Delete),
            _ => None,
        }
    }
}

/// One ACL rule.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    /// Who: user names, `*` (any authenticated user) or `anonymous`.
    pub users: Vec<String>,
    /// Which repositories: exact names, `prefix/*`, or `*`.
    pub repos: Vec<String>,
    /// What.
    pub actions: Vec<Action>,
}

impl Rule {
    /// Whether the rule speaks of `user` (None = anonymous).
    fn covers(&self, user: Option<&str>) -> bool {
        self.users.iter().any(|u| match user {
            None => u == "anonymous",
            Some(name) => u == "*" || u == name,
        })
    }
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct AclFile {
    #[serde(default)]
    rule: Vec<Rule>,
}

/// Errors loading auth configuration.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
#[non_exhaustive]
pub enum AuthConfigError {
    /// htpasswd line {line}: {reason}
    Htpasswd {
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        reason: String,
    },
    /// ACL file: {0}
    Acl(String),
    /// token secret must be at least 32 bytes, got {0}
    ShortSecret(usize),
    /// bcrypt: {0}
    Bcrypt(String),
}

/// Who is asking.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Identity {
    /// No credentials.
    Anonymous,
    /// A user who presented a valid password.
    User(String),
    /// A valid bearer token: its subject and the access it grants.
    Token {
        /// User name, empty for anonymous.
        sub: String,
        /// Granted (repository, action) pairs.
        access: HashSet<(String, Action)>,
    },
}

/// Credentials were presented but are wrong.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum Rejected {
    /// invalid username or password
    BadPassword,
    /// invalid or expired token
    BadToken,
    /// malformed Authorization header
    Malformed,
}

/// One `access` entry of a token (docker token spec).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Access {
    /// Always `repository` here.
    #[serde(rename = "type")]
    pub kind: String,
    /// Repository name.
    pub name: String,
    /// Granted actions.
    pub actions: Vec<String>,
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Claims {
    iss: String,
    sub: String,
    aud: String,
    exp: u64,
    iat: u64,
    access: Vec<Access>,
}

/// The users of one htpasswd file, and what checking passwords against it has learnt.
/// Replaced whole when the file changes ([`Auth::reload_users`]), so a password checked
/// against the old file can never be remembered as valid for the new one.
#[derive(Debug)]
struct Users {
    hashes: HashMap<String, String>,
    /// Successful (user, sha256(password)) checks, so bcrypt runs once per credential.
    verified: Mutex<HashSet<(String, [u8; 32])>>,
    /// A bcrypt hash of no one's password, at the highest cost among the users: an
    /// unknown user's password is checked against it, so a wrong user name costs the same
    /// time as a wrong password (0.5 ms against 60 ms told an attacker which names exist).
    dummy: String,
}

impl Users {
    fn load(htpasswd: &str) -> Result<Users, AuthConfigError> {
        let hashes = parse_htpasswd(htpasswd)?;
        // With no users there is no name to hide: the cheapest cost will do.
        let cost = hashes.values().filter_map(|h| bcrypt_cost(h)).max().unwrap_or(4).clamp(4, 31);
        let dummy = bcrypt::hash(hex::encode(random_secret()), cost).map_err(|e| AuthConfigError::Bcrypt(e.to_string()))?;
        Ok(Users { hashes, verified: Mutex::new(HashSet::new()), dummy })
    }
}

/// The auth configuration of a server.
#[derive(Debug)]
pub struct Auth {
    users: RwLock<Arc<Users>>,
    rules: Vec<Rule>,
    secret: Vec<u8>,
    /// `service` of the token flow.
    pub service: String,
    /// Token realm URL; `None` derives `http(s)://<Host>/token` from each request.
    pub realm: Option<String>,
    /// bcrypt verifications run (tests observe that every path runs one).
    bcrypt_runs: std::sync::atomic::AtomicU64,
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// Whether repository `name` matches an ACL pattern.
pub fn repo_matches(pattern: &str, name: &str) -> bool {
    if pattern == "*" {
        return true;
    }
    if let Some(prefix) = pattern.strip_suffix("/*") {
        return name.strip_prefix(prefix).is_some_and(|r| r.starts_with('/'));
    }
    pattern == name
}

/// The cost of a bcrypt hash (`$2y$10$...` -> 10).
fn bcrypt_cost(hash: &str) -> Option<u32> {
    hash.split('$').nth(2)?.parse().ok()
}

/// Parse an htpasswd file (bcrypt only).
pub fn parse_htpasswd(text: &str) -> Result<HashMap<String, String>, AuthConfigError> {
    let mut users = HashMap::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let err = |reason: &str| AuthConfigError::Htpasswd { line: i + 1, reason: reason.to_owned() };
        let (u, h) = line.split_once(':').ok_or_else(|| err("expected user:hash"))?;
        if u.is_empty() {
            return Err(err("empty user name"));
        }
        if !(h.starts_with("$2y$") || h.starts_with("$2b$") || h.starts_with("$2a$")) {
            return Err(err("only bcrypt hashes ($2y$/$2b$/$2a$, `htpasswd -B`) are supported"));
        }
        users.insert(u.to_owned(), h.to_owned());
    }
    Ok(users)
}

impl Auth {
    /// Build from htpasswd text, optional ACL TOML text, the anonymous-read switch and
    /// the token signing secret (>= 32 bytes).
    pub fn new(htpasswd: &str, acl: Option<&str>, anonymous_read: bool, secret: Vec<u8>) -> Result<Auth, AuthConfigError> {
        if secret.len() < 32 {
            return Err(AuthConfigError::ShortSecret(secret.len()));
        }
        let users = Users::load(htpasswd)?;
        let mut rules = match acl {
            Some(t) => toml::from_str::<AclFile>(t).map_err(|e| AuthConfigError::Acl(e.to_string()))?.rule,
            None => vec![Rule { users: vec!["*".into()], repos: vec!["*".into()], actions: vec![Action::Pull, Action::Push, Action::Delete] }],
        };
        if anonymous_read {
            rules.push(Rule { users: vec!["anonymous".into()], repos: vec!["*".into()], actions: vec![Action::Pull] });
        }
        Ok(Auth { users: RwLock::new(Arc::new(users)), rules, secret, service: "snapctl".into(), realm: None, bcrypt_runs: Default::default() })
    }

    /// Replace the users with those of `htpasswd` (the file changed). Passwords verified
    /// before are forgotten. On an error the users stay as they were. Returns how many
    /// users there are now.
    pub fn reload_users(&self, htpasswd: &str) -> Result<usize, AuthConfigError> {
        let users = Users::load(htpasswd)?;
        let n = users.hashes.len();
        *self.users.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(users);
        Ok(n)
    }

    fn users(&self) -> Arc<Users> {
        self.users.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Whether a user (None = anonymous) has `action` on `repo` per the ACL.
    pub fn acl_allows(&self, user: Option<&str>, repo: &str, action: Action) -> bool {
        self.rules.iter().any(|r| r.covers(user) && r.actions.contains(&action) && r.repos.iter().any(|p| repo_matches(p, repo)))
    }

    /// The repository patterns of the rules that give a user (None = anonymous) `action`:
    /// the repositories the catalog may show them.
    pub fn acl_patterns(&self, user: Option<&str>, action: Action) -> Vec<String> {
        self.rules.iter().filter(|r| r.covers(user) && r.actions.contains(&action)).flat_map(|r| r.repos.iter().cloned()).collect()
    }

    /// Whether `id` may do `action` on `repo`.
    pub fn allows(&self, id: &Identity, repo: &str, action: Action) -> bool {
        match id {
            Identity::Anonymous => self.acl_allows(None, repo, action),
            Identity::User(u) => self.acl_allows(Some(u), repo, action),
            Identity::Token { access, .. } => access.contains(&(repo.to_owned(), action)),
        }
    }

    /// Check a password (bcrypt, cached on success).
    pub fn check_password(&self, user: &str, password: &str) -> bool {
        let key = (user.to_owned(), <[u8; 32]>::from(Sha256::digest(password.as_bytes())));
        let users = self.users();
        if users.verified.lock().unwrap_or_else(|p| p.into_inner()).contains(&key) {
            return true;
        }
        // Unknown users are checked against the dummy hash (same cost), and fail.
        let (hash, known) = match users.hashes.get(user) {
            Some(h) => (h.as_str(), true),
            None => (users.dummy.as_str(), false),
        };
        self.bcrypt_runs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let ok = bcrypt::verify(password, hash).unwrap_or(false) && known;
        if ok {
            users.verified.lock().unwrap_or_else(|p| p.into_inner()).insert(key);
        }
        ok
    }

    /// Who sent these headers. Wrong credentials are an error, no credentials are
    /// `Anonymous`. Runs bcrypt: call off the reactor for uncached passwords.
    pub fn identify(&self, headers: &HeaderMap) -> Result<Identity, Rejected> {
        let Some(v) = headers.get(header::AUTHORIZATION) else { return Ok(Identity::Anonymous) };
        let v = v.to_str().map_err(|_| Rejected::Malformed)?;
        if let Some(b) = v.strip_prefix("Basic ").or_else(|| v.strip_prefix("basic ")) {
            let (u, p) = basic_credentials(b).ok_or(Rejected::Malformed)?;
            if self.check_password(&u, &p) {
                Ok(Identity::User(u))
            } else {
                Err(Rejected::BadPassword)
            }
        } else if let Some(t) = v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")) {
            self.verify_token(t.trim()).ok_or(Rejected::BadToken)
        } else {
            Err(Rejected::Malformed)
        }
    }

    fn sign(&self, data: &[u8]) -> Vec<u8> {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.secret).expect("HMAC takes any key length");
        mac.update(data);
        mac.finalize().into_bytes().to_vec()
    }

    /// Issue a token for `sub` (empty for anonymous) granting the requested scopes
    /// intersected with what the ACL allows. Returns the token and the granted access.
    pub fn issue_token(&self, sub: Option<&str>, scopes: &[String]) -> (String, Vec<Access>) {
        let mut access: Vec<Access> = Vec::new();
        for s in scopes {
            // repository:<name>:<actions>; the name may itself not contain ':'.
            let mut it = s.splitn(3, ':');
            let (Some(kind), Some(name), Some(acts)) = (it.next(), it.next(), it.next()) else { continue };
            if kind != "repository" {
                continue;
            }
            let wanted: Vec<Action> =
                if acts == "*" { vec![Action::Pull, Action::Push, Action::Delete] } else { acts.split(',').filter_map(Action::parse).collect() };
            let granted: Vec<String> = wanted.into_iter().filter(|a| self.acl_allows(sub, name, *a)).map(|a| a.as_str().to_owned()).collect();
            if let Some(e) = access.iter_mut().find(|e| e.name == name) {
                for g in granted {
                    if !e.actions.contains(&g) {
                        e.actions.push(g);
                    }
                }
            } else {
                access.push(Access { kind: "repository".into(), name: name.to_owned(), actions: granted });
            }
        }
        let iat = now();
        let claims = Claims {
            iss: "snapctl".into(),
            sub: sub.unwrap_or("").to_owned(),
            aud: self.service.clone(),
            exp: iat + TOKEN_TTL.as_secs(),
            iat,
            access: access.clone(),
        };
        let head = URL_SAFE_NO_PAD.encode(br#"{"alg":"HS256","typ":"JWT"}"#);
        let body = URL_SAFE_NO_PAD.encode(serde_json::to_vec(&claims).expect("claims serialize"));
        let signing_input = format!("{head}.{body}");
        let sig = URL_SAFE_NO_PAD.encode(self.sign(signing_input.as_bytes()));
        (format!("{signing_input}.{sig}"), access)
    }

    /// Check a token's signature and expiry; return what it grants.
    pub fn verify_token(&self, token: &str) -> Option<Identity> {
        let (signing_input, sig) = token.rsplit_once('.')?;
        let sig = URL_SAFE_NO_PAD.decode(sig).ok()?;
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.secret).ok()?;
        mac.update(signing_input.as_bytes());
        mac.verify_slice(&sig).ok()?; // constant time
        let (_, body) = signing_input.split_once('.')?;
        let claims: Claims = serde_json::from_slice(&URL_SAFE_NO_PAD.decode(body).ok()?).ok()?;
        if claims.exp <= now() || claims.aud != self.service {
            return None;
        }
        let access = claims.access.iter().flat_map(|a| a.actions.iter().filter_map(|x| Action::parse(x)).map(|x| (a.name.clone(), x))).collect();
        Some(Identity::Token { sub: claims.sub, access })
    }
}

/// A fresh random token secret (32 bytes). Replicas behind one load balancer need a
/// shared secret instead (`--token-secret-file`).
pub fn random_secret() -> Vec<u8> {
    rand::random::<[u8; 32]>().to_vec()
}

/// Decode the base64 part of a Basic header into (user, password).
pub fn basic_credentials(b64: &str) -> Option<(String, String)> {
    let raw = STANDARD.decode(b64.trim()).ok()?;
    let s = String::from_utf8(raw).ok()?;
    let (u, p) = s.split_once(':')?;
    Some((u.to_owned(), p.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn auth(acl: Option<&str>, anon: bool) -> Auth {
        let h = bcrypt::hash("secret", 4).unwrap();
        Auth::new(&format!("alice:{h}\nbob:{h}\n"), acl, anon, vec![7; 32]).unwrap()
    }

    #[test]
    fn default_rules() {
        let a = auth(None, false);
        assert!(a.acl_allows(Some("alice"), "x", Action::Push));
        assert!(!a.acl_allows(None, "x", Action::Pull));
        let a = auth(None, true);
        assert!(a.acl_allows(None, "x", Action::Pull));
        assert!(!a.acl_allows(None, "x", Action::Push));
    }

    #[test]
    fn acl_file_rules() {
        let acl = r#"
            [[rule]]
            users = ["alice"]
            repos = ["team/*"]
            actions = ["pull", "push"]
            [[rule]]
            users = ["*"]
            repos = ["public"]
            actions = ["pull"]
        "#;
        let a = auth(Some(acl), false);
        assert!(a.acl_allows(Some("alice"), "team/a/b", Action::Push));
        assert!(!a.acl_allows(Some("alice"), "team", Action::Push));
        assert!(!a.acl_allows(Some("alice"), "teamx/a", Action::Pull));
        assert!(!a.acl_allows(Some("bob"), "team/a", Action::Pull));
        assert!(a.acl_allows(Some("bob"), "public", Action::Pull));
        assert!(!a.acl_allows(None, "public", Action::Pull));
        assert!(Auth::new("", Some("[[rule]]\nusers=[1]"), false, vec![0; 32]).is_err());
    }

    #[test]
    fn passwords_and_headers() {
        let a = auth(None, false);
        let mut h = HeaderMap::new();
        assert_eq!(a.identify(&h).unwrap(), Identity::Anonymous);
        h.insert(header::AUTHORIZATION, format!("Basic {}", STANDARD.encode("alice:secret")).parse().unwrap());
        assert_eq!(a.identify(&h).unwrap(), Identity::User("alice".into()));
        assert_eq!(a.identify(&h).unwrap(), Identity::User("alice".into()), "cached path");
        h.insert(header::AUTHORIZATION, format!("Basic {}", STANDARD.encode("alice:wrong")).parse().unwrap());
        assert!(matches!(a.identify(&h), Err(Rejected::BadPassword)));
        h.insert(header::AUTHORIZATION, format!("Basic {}", STANDARD.encode("carol:secret")).parse().unwrap());
        assert!(matches!(a.identify(&h), Err(Rejected::BadPassword)));
        assert!(parse_htpasswd("eve:{SHA}abc").is_err());
    }

    /// Issue 14: an unknown user answered in 0.5 ms, a known one in 60 ms. Both paths now
    /// run one bcrypt verification, against a dummy hash of the users' cost.
    #[test]
    fn regression_issue_14_unknown_users_cost_one_bcrypt_verification_too() {
        let h = bcrypt::hash("secret", 5).unwrap();
        let a = Auth::new(&format!("alice:{h}\n"), None, false, vec![7; 32]).unwrap();
        assert_eq!(bcrypt_cost(&a.users().dummy), Some(5), "dummy hash has the users' cost: {}", a.users().dummy);
        let runs = || a.bcrypt_runs.load(std::sync::atomic::Ordering::Relaxed);
        assert!(!a.check_password("alice", "wrong"));
        assert_eq!(runs(), 1);
        assert!(!a.check_password("mallory", "secret"));
        assert_eq!(runs(), 2, "an unknown user must cost a bcrypt verification");
        assert!(!a.check_password("mallory", ""), "nothing verifies as an unknown user");
        assert!(a.check_password("alice", "secret"));
        assert_eq!(runs(), 4);
        assert!(a.check_password("alice", "secret"));
        assert_eq!(runs(), 4, "a verified credential is cached");
    }

    #[test]
    fn regression_issue_25_reloaded_users_replace_the_old_ones_and_their_cached_passwords() {
        let a = auth(None, false);
        assert!(a.check_password("alice", "secret"), "cached from now on");
        let h = bcrypt::hash("new", 4).unwrap();
        assert_eq!(a.reload_users(&format!("alice:{h}\ncarol:{h}\n")).unwrap(), 2);
        assert!(!a.check_password("alice", "secret"), "the old password, cached before, is refused");
        assert!(a.check_password("alice", "new"));
        assert!(a.check_password("carol", "new"));
        assert!(!a.check_password("bob", "secret"), "a user removed from the file is refused");
        assert!(a.reload_users("eve:{SHA}abc").is_err());
        assert!(a.check_password("alice", "new"), "a bad file leaves the users as they were");
    }

    #[test]
    fn tokens_grant_only_what_acl_allows_and_cannot_be_forged() {
        let acl = "[[rule]]\nusers=[\"alice\"]\nrepos=[\"a\"]\nactions=[\"pull\"]\n";
        let a = auth(Some(acl), false);
        let (tok, access) = a.issue_token(Some("alice"), &["repository:a:pull,push".into(), "repository:b:pull".into()]);
        assert_eq!(access[0].actions, ["pull"]);
        assert!(access[1].actions.is_empty());
        let id = a.verify_token(&tok).unwrap();
        assert!(a.allows(&id, "a", Action::Pull));
        assert!(!a.allows(&id, "a", Action::Push));
        assert!(!a.allows(&id, "b", Action::Pull));
        // Flip one character of the payload: signature no longer matches.
        let mut bad = tok.clone().into_bytes();
        let i = tok.find('.').unwrap() + 3;
        bad[i] = if bad[i] == b'A' { b'B' } else { b'A' };
        assert!(a.verify_token(std::str::from_utf8(&bad).unwrap()).is_none());
        let other = Auth::new("", None, false, vec![8; 32]).unwrap();
        assert!(other.verify_token(&tok).is_none(), "another secret must not verify");
    }
}
