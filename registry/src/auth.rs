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
//!
//! Checking a password costs a bcrypt verification (tens of milliseconds of CPU, on
//! purpose), which anyone who can send a Basic header can ask for. So:
//! ```text
//! Basic user:pass ─> verified recently? (HMAC-keyed cache, TTL, bounded) ─> user, no bcrypt
//!                 ─> client failing repeatedly? (per address, bounded table) ─> 429 + Retry-After
//!                 ─> a bcrypt slot free? (at most `max_checks` at once) ─> no: 503 + Retry-After
//!                 ─> bcrypt: ok = cache it, clear the client's failures; wrong = count a failure
//! ```
//! An honest client pays bcrypt once per [`VERIFIED_TTL`], whatever a flood of wrong
//! passwords from elsewhere (or from its own address) is doing.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::http::{header, HeaderMap};
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use base64::Engine as _;
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// How long an issued token is valid.
pub const TOKEN_TTL: Duration = Duration::from_secs(300);

/// How long a verified (user, password) pair is taken without bcrypt.
pub const VERIFIED_TTL: Duration = Duration::from_secs(300);
/// Most verified pairs remembered; past it the one expiring first is forgotten.
pub const VERIFIED_ENTRIES: usize = 1024;
/// Wrong passwords a client (address) may send before it is made to wait.
pub const FREE_FAILURES: u32 = 5;
/// The first wait of a failing client; it doubles with each further failure.
pub const FIRST_BACKOFF: Duration = Duration::from_secs(1);
/// The longest wait of a failing client.
pub const MAX_BACKOFF: Duration = Duration::from_secs(60);
/// A client's failures are forgotten this long after its last one.
pub const FAILURES_FORGOTTEN: Duration = Duration::from_secs(600);
/// Most failing clients tracked; past it the one that failed least recently is forgotten.
pub const TRACKED_CLIENTS: usize = 4096;

/// Default bound on bcrypt verifications running at once: half the cores (at least one),
/// so password checking alone can never take every core from the requests that need none.
pub fn default_max_password_checks() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get() / 2).max(1)
}

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
    /// the htpasswd file has no users: it would let nobody in (a file still being written?)
    NoUsers,
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

/// Credentials were presented but are wrong, or cannot be checked now.
#[derive(Debug, thiserror::Error, displaydoc::Display)]
pub enum Rejected {
    /// invalid username or password
    BadPassword,
    /// invalid or expired token
    BadToken,
    /// malformed Authorization header
    Malformed,
    /// too many failed logins from this address: try again later
    Backoff {
        /// When the client may try again.
        retry_after: Duration,
    },
    /// too many password checks in progress: try again shortly
    Busy,
}

/// What the password checks have done since the server started (for `/metrics`).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct AuthStats {
    /// bcrypt verifications run.
    pub password_checks: u64,
    /// Basic credentials answered from the verified cache.
    pub cache_hits: u64,
    /// Requests refused without a check: their client was backing off.
    pub refused_backoff: u64,
    /// Requests refused without a check: every bcrypt slot was busy.
    pub refused_busy: u64,
}

/// One client's recent failures.
#[derive(Debug, Clone, Copy)]
struct Failures {
    count: u32,
    last: Instant,
    until: Instant,
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

/// The users of one htpasswd file, and the passwords verified against it. Replaced whole
/// when the file changes ([`Auth::reload_users`]), so a password verified against the old
/// file can never be remembered as valid for the new one.
#[derive(Debug)]
struct Users {
    hashes: HashMap<String, String>,
    /// Verified credentials, keyed by HMAC(`cache_key`, user NUL password) (the password
    /// itself is not kept, nor a hash of it that could be tried offline), with when each
    /// stops counting. At most [`VERIFIED_ENTRIES`].
    verified: Mutex<HashMap<[u8; 32], (String, Instant)>>,
    /// A bcrypt hash of no one's password, at the highest cost among the users: an
    /// unknown user's password is checked against it, so a wrong user name costs the same
    /// time as a wrong password (0.5 ms against 60 ms told an attacker which names exist).
    dummy: String,
}

impl Users {
    fn load(htpasswd: &str) -> Result<Users, AuthConfigError> {
        let hashes = parse_htpasswd(htpasswd)?;
        if hashes.is_empty() {
            return Err(AuthConfigError::NoUsers);
        }
        // With no users there is no name to hide: the cheapest cost will do.
        let cost = hashes.values().filter_map(|h| bcrypt_cost(h)).max().unwrap_or(4).clamp(4, 31);
        let dummy = bcrypt::hash(hex::encode(random_secret()), cost).map_err(|e| AuthConfigError::Bcrypt(e.to_string()))?;
        Ok(Users { hashes, verified: Mutex::new(HashMap::new()), dummy })
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
    /// A per-process random key for [`Users::verified`].
    cache_key: [u8; 32],
    /// Failing clients, at most [`TRACKED_CLIENTS`].
    failures: Mutex<HashMap<IpAddr, Failures>>,
    /// bcrypt verifications running now, and the most allowed.
    checking: AtomicUsize,
    /// At most this many bcrypt verifications at once (at least 1).
    pub max_checks: usize,
    cache_hits: AtomicU64,
    refused_backoff: AtomicU64,
    refused_busy: AtomicU64,
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
        if !is_bcrypt_hash(h) {
            return Err(err("not a whole bcrypt hash ($2y$<cost>$ and 53 characters of salt and hash; a file cut short?)"));
        }
        users.insert(u.to_owned(), h.to_owned());
    }
    Ok(users)
}

/// Whether `h` is a whole bcrypt hash: `$2a$`, `$2b$` or `$2y$`, a two-digit cost from 04
/// to 31, `$`, and 53 characters of bcrypt's base64 (22 of salt, 31 of hash).
fn is_bcrypt_hash(h: &str) -> bool {
    let b = h.as_bytes();
    b.len() == 60
        && bcrypt_cost(h).is_some_and(|c| (4..=31).contains(&c))
        && b[4..6].iter().all(u8::is_ascii_digit)
        && b[6] == b'$'
        && b[7..].iter().all(|&c| c.is_ascii_alphanumeric() || c == b'.' || c == b'/')
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
        Ok(Auth {
            users: RwLock::new(Arc::new(users)),
            rules,
            secret,
            service: "snapctl".into(),
            realm: None,
            cache_key: rand::random(),
            failures: Mutex::new(HashMap::new()),
            checking: AtomicUsize::new(0),
            max_checks: default_max_password_checks(),
            cache_hits: AtomicU64::new(0),
            refused_backoff: AtomicU64::new(0),
            refused_busy: AtomicU64::new(0),
            bcrypt_runs: Default::default(),
        })
    }

    /// Replace the users with those of `htpasswd` (the file changed). Passwords verified
    /// before are forgotten with the old users. On an error the users stay as they were.
    /// Returns how many users there are now.
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

    /// Check a password (bcrypt, cached on success), with no client to back off and no
    /// bound on checks at once.
    pub fn check_password(&self, user: &str, password: &str) -> bool {
        let users = self.users();
        let key = self.verified_key(user, password);
        self.cached(&users, &key) || self.bcrypt(&users, user, password, &key)
    }

    /// Where a verified `user`/`password` pair is remembered.
    fn verified_key(&self, user: &str, password: &str) -> [u8; 32] {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.cache_key).expect("HMAC takes any key length");
        mac.update(user.as_bytes());
        mac.update(&[0]);
        mac.update(password.as_bytes());
        mac.finalize().into_bytes().into()
    }

    /// Whether `key` was verified within [`VERIFIED_TTL`].
    fn cached(&self, users: &Users, key: &[u8; 32]) -> bool {
        let v = users.verified.lock().unwrap_or_else(|p| p.into_inner());
        let hit = v.get(key).is_some_and(|(_, until)| *until > Instant::now());
        if hit {
            self.cache_hits.fetch_add(1, Relaxed);
        }
        hit
    }

    /// One bcrypt verification; remembers a success under `key`.
    fn bcrypt(&self, users: &Users, user: &str, password: &str, key: &[u8; 32]) -> bool {
        // Unknown users are checked against the dummy hash (same cost), and fail.
        let (hash, known) = match users.hashes.get(user) {
            Some(h) => (h.as_str(), true),
            None => (users.dummy.as_str(), false),
        };
        self.bcrypt_runs.fetch_add(1, Relaxed);
        let ok = bcrypt::verify(password, hash).unwrap_or(false) && known;
        if ok {
            let now = Instant::now();
            let mut v = users.verified.lock().unwrap_or_else(|p| p.into_inner());
            if v.len() >= VERIFIED_ENTRIES {
                v.retain(|_, (_, until)| *until > now);
            }
            if v.len() >= VERIFIED_ENTRIES {
                if let Some(first) = v.iter().min_by_key(|(_, (_, until))| *until).map(|(k, _)| *k) {
                    v.remove(&first);
                }
            }
            v.insert(*key, (user.to_owned(), now + VERIFIED_TTL));
        }
        ok
    }

    /// How long `client` must still wait before its password is checked again.
    fn backing_off(&self, client: IpAddr, now: Instant) -> Option<Duration> {
        let f = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        f.get(&client).map(|f| f.until.saturating_duration_since(now)).filter(|d| !d.is_zero())
    }

    /// Count a wrong password from `client`: past [`FREE_FAILURES`] it waits, 1 s doubling
    /// to [`MAX_BACKOFF`], before the next is checked.
    fn failed(&self, client: IpAddr) {
        let now = Instant::now();
        let mut t = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        if !t.contains_key(&client) && t.len() >= TRACKED_CLIENTS {
            t.retain(|_, f| f.until > now || now.duration_since(f.last) < FAILURES_FORGOTTEN);
            if t.len() >= TRACKED_CLIENTS {
                if let Some(oldest) = t.iter().min_by_key(|(_, f)| f.last).map(|(k, _)| *k) {
                    t.remove(&oldest);
                }
            }
        }
        let f = t.entry(client).or_insert(Failures { count: 0, last: now, until: now });
        if now.duration_since(f.last) >= FAILURES_FORGOTTEN {
            f.count = 0;
        }
        f.count = f.count.saturating_add(1);
        f.last = now;
        if f.count >= FREE_FAILURES {
            let wait = FIRST_BACKOFF.saturating_mul(1u32 << (f.count - FREE_FAILURES).min(16)).min(MAX_BACKOFF);
            f.until = now + wait;
        }
    }

    /// Check `user`/`password` for a request from `client` (`None`: no backoff): from the
    /// verified cache, else by bcrypt if the client is not backing off and a check slot is
    /// free. Runs bcrypt: call off the reactor.
    pub fn check_basic(&self, user: &str, password: &str, client: Option<IpAddr>) -> Result<(), Rejected> {
        let users = self.users();
        let key = self.verified_key(user, password);
        if self.cached(&users, &key) {
            return Ok(());
        }
        if let Some(retry_after) = client.and_then(|c| self.backing_off(c, Instant::now())) {
            self.refused_backoff.fetch_add(1, Relaxed);
            return Err(Rejected::Backoff { retry_after });
        }
        let max = self.max_checks.max(1);
        if self.checking.fetch_update(Relaxed, Relaxed, |n| (n < max).then_some(n + 1)).is_err() {
            self.refused_busy.fetch_add(1, Relaxed);
            return Err(Rejected::Busy);
        }
        struct Slot<'a>(&'a AtomicUsize);
        impl Drop for Slot<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Relaxed);
            }
        }
        let _slot = Slot(&self.checking);
        if self.bcrypt(&users, user, password, &key) {
            if let Some(c) = client {
                self.failures.lock().unwrap_or_else(|p| p.into_inner()).remove(&c);
            }
            Ok(())
        } else {
            if let Some(c) = client {
                self.failed(c);
            }
            Err(Rejected::BadPassword)
        }
    }

    /// What password checking has done so far.
    pub fn stats(&self) -> AuthStats {
        AuthStats {
            password_checks: self.bcrypt_runs.load(Relaxed),
            cache_hits: self.cache_hits.load(Relaxed),
            refused_backoff: self.refused_backoff.load(Relaxed),
            refused_busy: self.refused_busy.load(Relaxed),
        }
    }

    /// Who sent these headers. Wrong credentials are an error, no credentials are
    /// `Anonymous`. Runs bcrypt: call off the reactor for uncached passwords.
    pub fn identify(&self, headers: &HeaderMap) -> Result<Identity, Rejected> {
        self.identify_client(headers, None)
    }

    /// [`Auth::identify`] for a request from `client` (an IPv4 address or an IPv6 /64),
    /// whose repeated wrong passwords make it wait ([`Auth::check_basic`]).
    pub fn identify_client(&self, headers: &HeaderMap, client: Option<IpAddr>) -> Result<Identity, Rejected> {
        let Some(v) = headers.get(header::AUTHORIZATION) else { return Ok(Identity::Anonymous) };
        let v = v.to_str().map_err(|_| Rejected::Malformed)?;
        if let Some(b) = v.strip_prefix("Basic ").or_else(|| v.strip_prefix("basic ")) {
            let (u, p) = basic_credentials(b).ok_or(Rejected::Malformed)?;
            self.check_basic(&u, &p, client)?;
            Ok(Identity::User(u))
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
        assert!(Auth::new(&format!("alice:{}", bcrypt::hash("pw", 4).unwrap()), Some("[[rule]]\nusers=[1]"), false, vec![0; 32]).is_err());
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

    /// Issue 21 §2: every request with a Basic header cost a bcrypt verification, however
    /// often its client had failed and however many ran at once. Now a client failing
    /// repeatedly waits without a check, checks at once are bounded, and a verified
    /// credential is remembered (keyed, bounded, for a while).
    #[test]
    fn regression_issue_21_wrong_passwords_back_off_and_checks_are_bounded() {
        let a = auth(None, false);
        let runs = || a.stats().password_checks;
        let mallory: IpAddr = "192.0.2.66".parse().unwrap();
        for i in 0..FREE_FAILURES {
            assert!(matches!(a.check_basic("alice", &format!("guess{i}"), Some(mallory)), Err(Rejected::BadPassword)));
        }
        assert_eq!(runs(), u64::from(FREE_FAILURES));
        for i in 0..200 {
            let e = a.check_basic("alice", &format!("more{i}"), Some(mallory)).unwrap_err();
            assert!(matches!(e, Rejected::Backoff { retry_after } if retry_after <= FIRST_BACKOFF), "{e:?}");
        }
        assert_eq!(runs(), u64::from(FREE_FAILURES), "a client in backoff made bcrypt run");
        assert_eq!(a.stats().refused_backoff, 200);
        // Even the right password waits while its address backs off ...
        assert!(matches!(a.check_basic("alice", "secret", Some(mallory)), Err(Rejected::Backoff { .. })));
        // ... but another address is checked, and then remembered.
        let honest: IpAddr = "192.0.2.7".parse().unwrap();
        a.check_basic("alice", "secret", Some(honest)).unwrap();
        let checks = runs();
        for _ in 0..100 {
            a.check_basic("alice", "secret", Some(honest)).unwrap();
            a.check_basic("alice", "secret", Some(mallory)).unwrap();
        }
        assert_eq!(runs(), checks, "a verified credential was checked again");
        assert_eq!(a.stats().cache_hits, 200);
        // No free slot: answered at once, not queued.
        a.checking.store(a.max_checks, Relaxed);
        assert!(matches!(a.check_basic("bob", "secret", Some(honest)), Err(Rejected::Busy)));
        assert_eq!((runs(), a.stats().refused_busy), (checks, 1));
        a.checking.store(0, Relaxed);
        a.check_basic("bob", "secret", Some(honest)).unwrap();
    }

    #[test]
    fn the_verified_cache_and_the_failure_table_are_bounded() {
        let a = auth(None, false);
        let key = |i: usize| a.verified_key("alice", &format!("{i}"));
        let users = a.users();
        {
            let mut v = users.verified.lock().unwrap();
            for i in 0..VERIFIED_ENTRIES {
                v.insert(key(i), ("alice".into(), Instant::now() + VERIFIED_TTL));
            }
            v.insert(key(0), ("alice".into(), Instant::now() - Duration::from_secs(1)));
        }
        assert!(!a.cached(&users, &key(0)), "an expired entry counts");
        assert!(a.check_password("alice", "secret"));
        assert_eq!(users.verified.lock().unwrap().len(), VERIFIED_ENTRIES, "bounded");
        for i in 0..TRACKED_CLIENTS as u32 + 10 {
            a.failed(IpAddr::V4(i.into()));
        }
        assert_eq!(a.failures.lock().unwrap().len(), TRACKED_CLIENTS);
        let other = Auth::new(&format!("alice:{}", bcrypt::hash("pw", 4).unwrap()), None, false, vec![7; 32]).unwrap();
        assert_ne!(a.verified_key("alice", "x"), other.verified_key("alice", "x"), "keyed per process");
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

    /// Issue 35: an htpasswd file caught half-written (empty, or cut inside a hash) was
    /// loaded as it was, and every user locked out until the next change. Neither parses
    /// now: at start it is refused with its line, on reload the users stay as they were.
    #[test]
    fn regression_issue_35_a_half_written_htpasswd_is_refused_and_keeps_the_users_loaded_before() {
        let a = auth(None, false);
        let whole = format!("alice:{}\nbob:{}\n", bcrypt::hash("a", 4).unwrap(), bcrypt::hash("b", 4).unwrap());
        let cut = &whole[..whole.len() - 20];
        match parse_htpasswd(cut) {
            Err(AuthConfigError::Htpasswd { line: 2, reason }) => assert!(reason.contains("cut short"), "{reason}"),
            other => panic!("{other:?}"),
        }
        assert!(Auth::new(cut, None, false, vec![7; 32]).is_err(), "refused at start");
        for half in ["", "\n", "# users\n", cut] {
            assert!(a.reload_users(half).is_err(), "{half:?}");
            assert!(a.check_password("alice", "secret"), "{half:?}: the users loaded before stay");
        }
        assert!(matches!(Auth::new("", None, false, vec![7; 32]), Err(AuthConfigError::NoUsers)));
        assert_eq!(a.reload_users(&whole).unwrap(), 2, "the whole file, once written, is taken");
        assert!(a.check_password("bob", "b"));
        for bad in
            ["$2y$10$short", "$2y$99$abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0", "$2y$1a$abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ012"]
        {
            assert!(!is_bcrypt_hash(bad), "{bad}");
        }
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
        let other = Auth::new(&format!("alice:{}", bcrypt::hash("pw", 4).unwrap()), None, false, vec![8; 32]).unwrap();
        assert!(other.verify_token(&tok).is_none(), "another secret must not verify");
    }
}
