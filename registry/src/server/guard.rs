//! Who is asking and what they may do: the caller identified from Basic credentials or a
//! token, the 401/403 answers with their `WWW-Authenticate` challenge, the checks each
//! route needs, what of the catalog a caller may see, and the docker token endpoint
//! `/token` that turns credentials into a bearer token.

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};

use super::wire::{client_ip, query, Client};
use super::Server;
use crate::auth::{Action, Identity, Rejected};
use crate::catalog::Readable;
use crate::error::{ApiError, Code};
use crate::name::RepoName;

/// The authority (`host[:port]`) a request was sent to: the URI's authority when it has
/// one (HTTP/2 sends `:authority` and no `Host`; an HTTP/1.1 absolute-form target
/// overrides `Host`), else the `Host` header. `None` when absent or not a plain
/// authority: it is echoed into the token realm, so nothing that could break out of
/// the quoted challenge parameter gets there.
pub fn request_authority<'a>(uri: &'a Uri, headers: &'a HeaderMap) -> Option<&'a str> {
    let a = uri.authority().map(|a| a.as_str()).or_else(|| headers.get(header::HOST)?.to_str().ok())?;
    let plain = !a.is_empty() && a.len() <= 255 && a.bytes().all(|b| b.is_ascii_alphanumeric() || b".-:[]_".contains(&b));
    plain.then_some(a)
}

impl Server {
    /// What `id` may see of the catalog; `None` when it may see nothing and presented no
    /// credentials (answered 401, so a client learns to log in).
    pub(super) fn readable(&self, id: &Identity) -> Option<Readable> {
        let Some(auth) = &self.cfg.auth else { return Some(Readable::All) };
        // A token names its user; the catalog shows what that user may pull now.
        let user = match id {
            Identity::Anonymous => None,
            Identity::User(u) => Some(u.as_str()),
            Identity::Token { sub, .. } => (!sub.is_empty()).then_some(sub.as_str()),
        };
        let r = Readable::from_patterns(auth.acl_patterns(user, Action::Pull));
        (user.is_some() || r != Readable::Only(Vec::new())).then_some(r)
    }

    /// The `WWW-Authenticate` Bearer challenge: the token realm (configured, else this
    /// server's `/token` at the authority the client used), the service, the scope wanted,
    /// and `insufficient_scope` when a token did not grant it.
    pub(super) fn challenge(&self, uri: &Uri, headers: &HeaderMap, scope: Option<String>, insufficient: bool) -> String {
        let auth = self.cfg.auth.as_ref().expect("challenge only with auth");
        let realm = auth.realm.clone().unwrap_or_else(|| {
            let host = request_authority(uri, headers).unwrap_or("localhost");
            format!("{}://{host}/token", if self.cfg.tls { "https" } else { "http" })
        });
        let mut c = format!("Bearer realm=\"{realm}\",service=\"{}\"", auth.service);
        if let Some(s) = scope {
            c.push_str(&format!(",scope=\"{s}\""));
        }
        if insufficient {
            c.push_str(",error=\"insufficient_scope\"");
        }
        c
    }

    /// Who sent the request: a user (Basic credentials), a token's holder, or anonymous.
    /// Bad credentials are a 401 with the challenge; a client held back after failed logins
    /// gets a 429, and one arriving while every password check is taken a 503, both with
    /// `Retry-After`.
    pub(super) async fn identify(&self, uri: &Uri, headers: &HeaderMap, client: Option<std::net::IpAddr>) -> Result<Identity, ApiError> {
        let Some(auth) = &self.cfg.auth else { return Ok(Identity::Anonymous) };
        let is_basic = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).is_some_and(|v| v.len() > 6 && v[..6].eq_ignore_ascii_case("basic "));
        let r = if is_basic {
            // bcrypt is deliberately slow (tens of ms per uncached check): on the
            // multi-thread runtime, let the other tasks of this worker move elsewhere.
            let h = headers.clone();
            match tokio::runtime::Handle::current().runtime_flavor() {
                tokio::runtime::RuntimeFlavor::MultiThread => tokio::task::block_in_place(|| auth.identify_client(&h, client)),
                _ => auth.identify_client(&h, client),
            }
        } else {
            auth.identify(headers)
        };
        match &r {
            Ok(Identity::User(u)) => crate::access::note_user(u),
            Ok(Identity::Token { sub, .. }) if !sub.is_empty() => crate::access::note_user(sub),
            _ => {}
        }
        r.map_err(|e: Rejected| match e {
            // Answered at once, without a check: the client waits and asks again.
            Rejected::Backoff { retry_after } => ApiError::new(StatusCode::TOO_MANY_REQUESTS, Code::TooManyRequests, e.to_string())
                .with_header(header::RETRY_AFTER, retry_after.as_secs().max(1).to_string()),
            Rejected::Busy => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, Code::TooManyRequests, e.to_string()).with_header(header::RETRY_AFTER, "1"),
            _ => ApiError::new(StatusCode::UNAUTHORIZED, Code::Unauthorized, e.to_string())
                .with_header(header::WWW_AUTHENTICATE, self.challenge(uri, headers, None, false)),
        })
    }

    /// Check that `id` may do `action` on `repo`; the error is the right 401/403.
    pub(super) fn authorize(&self, id: &Identity, uri: &Uri, headers: &HeaderMap, repo: &RepoName, action: Action) -> Result<(), ApiError> {
        let Some(auth) = &self.cfg.auth else { return Ok(()) };
        if auth.allows(id, repo.as_str(), action) {
            return Ok(());
        }
        let scope = format!(
            "repository:{repo}:{}",
            match action {
                Action::Pull => "pull",
                Action::Push => "pull,push",
                Action::Delete => "delete",
            }
        );
        let msg = format!("{} access to {repo} denied", action.as_str());
        Err(match id {
            Identity::User(_) => ApiError::new(StatusCode::FORBIDDEN, Code::Denied, msg),
            Identity::Anonymous => ApiError::new(StatusCode::UNAUTHORIZED, Code::Unauthorized, msg)
                .with_header(header::WWW_AUTHENTICATE, self.challenge(uri, headers, Some(scope), false)),
            Identity::Token { .. } => ApiError::new(StatusCode::UNAUTHORIZED, Code::Unauthorized, msg)
                .with_header(header::WWW_AUTHENTICATE, self.challenge(uri, headers, Some(scope), true)),
        })
    }

    /// Whether `id` may do `action` on `repo` (an open registry: anyone may).
    pub(super) fn may(&self, id: &Identity, repo: &RepoName, action: Action) -> bool {
        self.cfg.auth.as_ref().is_none_or(|a| a.allows(id, repo.as_str(), action))
    }
}

/// `GET /token?scope=…`: the docker token endpoint. Basic credentials (or none) for a
/// bearer token granting the scopes asked, as far as the ACL allows.
pub(super) async fn token(State(s): State<Arc<Server>>, client: Client, uri: Uri, headers: HeaderMap) -> Response {
    let Some(auth) = &s.cfg.auth else {
        return ApiError::not_found(Code::Unsupported, "authentication is not enabled").into_response();
    };
    let sub = match s.identify(&uri, &headers, client_ip(client)).await {
        Ok(Identity::User(u)) => Some(u),
        Ok(Identity::Anonymous) => None,
        Err(e) if e.status != StatusCode::UNAUTHORIZED => return e.into_response(),
        Ok(Identity::Token { .. }) | Err(_) => {
            return ApiError::new(StatusCode::UNAUTHORIZED, Code::Unauthorized, "invalid credentials")
                .with_header(header::WWW_AUTHENTICATE, "Basic realm=\"snapctl\"")
                .into_response();
        }
    };
    let q = query(&uri);
    let scopes: Vec<String> = q.iter().filter(|(k, _)| k == "scope").flat_map(|(_, v)| v.split(' ').map(str::to_owned)).collect();
    let (tok, _) = auth.issue_token(sub.as_deref(), &scopes);
    let issued = time::OffsetDateTime::now_utc().format(&time::format_description::well_known::Rfc3339).unwrap_or_default();
    axum::Json(serde_json::json!({
        "token": tok, "access_token": tok,
        "expires_in": crate::auth::TOKEN_TTL.as_secs(), "issued_at": issued,
    }))
    .into_response()
}
