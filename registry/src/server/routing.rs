//! Which `/v2/` endpoint a request is for, and its dispatch: repository names contain
//! `/`, so the path is parsed by hand from its end ([`parse_route`]); each route says the
//! access it needs ([`Route::action`]) and the class it is timed by ([`Route::class`]).
//! [`v2`] identifies the caller, checks the access and hands the request to the blob,
//! upload, manifest or listing handler; [`count`] counts, times and logs every request.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::wire::{client_ip, count_bytes, query, respond, stall_limited, Client, API_VERSION};
use super::{drain, Server};
use crate::auth::{Action, Identity};
use crate::error::{ApiError, Code};
use crate::name::RepoName;

/// A parsed `/v2/...` route. Names are validated; references are raw strings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// `/v2/`
    Base,
    /// `/v2/_catalog`
    Catalog,
    /// `/v2/<name>/blobs/<digest>`
    Blob(RepoName, String),
    /// `/v2/<name>/manifests/<reference>`
    Manifest(RepoName, String),
    /// `/v2/<name>/tags/list`
    Tags(RepoName),
    /// `/v2/<name>/referrers/<digest>`
    Referrers(RepoName, String),
    /// `/v2/<name>/blobs/uploads/`
    UploadStart(RepoName),
    /// `/v2/<name>/blobs/uploads/<id>`
    Upload(RepoName, String),
}

fn bad_name(n: &str) -> ApiError {
    ApiError::bad(Code::NameInvalid, format!("invalid repository name {n:?}"))
}

/// Parse the path of a `/v2/` request. `None` = no such endpoint (404).
pub fn parse_route(path: &str) -> Option<Result<Route, ApiError>> {
    let rest = path.strip_prefix("/v2")?;
    if rest.is_empty() || rest == "/" {
        return Some(Ok(Route::Base));
    }
    let rest = rest.strip_prefix('/')?;
    if rest == "_catalog" {
        return Some(Ok(Route::Catalog));
    }
    let segs: Vec<&str> = rest.split('/').collect();
    let n = segs.len();
    let name = |k: usize| -> Result<RepoName, ApiError> {
        let s = segs[..k].join("/");
        RepoName::parse(&s).map_err(|_| bad_name(&s))
    };
    let r = if n >= 4 && segs[n - 3] == "blobs" && segs[n - 2] == "uploads" {
        if segs[n - 1].is_empty() {
            name(n - 3).map(Route::UploadStart)
        } else {
            name(n - 3).map(|r| Route::Upload(r, segs[n - 1].to_owned()))
        }
    } else if n >= 3 && segs[n - 2] == "blobs" && segs[n - 1] == "uploads" {
        name(n - 2).map(Route::UploadStart)
    } else if n >= 3 && segs[n - 2] == "blobs" {
        name(n - 2).map(|r| Route::Blob(r, segs[n - 1].to_owned()))
    } else if n >= 3 && segs[n - 2] == "manifests" {
        name(n - 2).map(|r| Route::Manifest(r, segs[n - 1].to_owned()))
    } else if n >= 3 && segs[n - 2] == "tags" && segs[n - 1] == "list" {
        name(n - 2).map(Route::Tags)
    } else if n >= 3 && segs[n - 2] == "referrers" {
        name(n - 2).map(|r| Route::Referrers(r, segs[n - 1].to_owned()))
    } else {
        return None;
    };
    Some(r)
}

impl Route {
    /// The access a `method` request on this route needs: `None` for none (the base, and
    /// the catalog, which lists only what the caller may read). A method the route does
    /// not answer is refused (405).
    pub fn action(&self, method: &Method) -> Result<Option<Action>, ApiError> {
        let read = *method == Method::GET || *method == Method::HEAD;
        let need = match self {
            Route::Base => Some(None),
            Route::Catalog => read.then_some(None),
            Route::Blob(..) if *method == Method::DELETE => Some(Some(Action::Delete)),
            Route::Blob(..) => read.then_some(Some(Action::Pull)),
            Route::Manifest(..) if *method == Method::DELETE => Some(Some(Action::Delete)),
            Route::Manifest(..) if *method == Method::PUT => Some(Some(Action::Push)),
            Route::Manifest(..) => read.then_some(Some(Action::Pull)),
            Route::Tags(..) | Route::Referrers(..) => read.then_some(Some(Action::Pull)),
            Route::UploadStart(..) | Route::Upload(..) => Some(Some(Action::Push)),
        };
        need.ok_or_else(|| ApiError::new(StatusCode::METHOD_NOT_ALLOWED, Code::Unsupported, format!("{method} not allowed here")))
    }

    /// The class requests on this route are timed by (one of [`crate::metrics::ROUTES`]).
    pub fn class(&self) -> &'static str {
        match self {
            Route::Base => "base",
            Route::Catalog => "catalog",
            Route::Blob(..) => "blob",
            Route::Manifest(..) => "manifest",
            Route::Tags(..) => "tags",
            Route::Referrers(..) => "referrers",
            Route::UploadStart(..) | Route::Upload(..) => "upload",
        }
    }
}

/// The route class of a request path (one of [`crate::metrics::ROUTES`]): a `/v2/` route's
/// [`Route::class`], the token, metrics and web endpoints', else `other` (no such
/// endpoint, or a name that is not valid).
pub fn route_class(path: &str) -> &'static str {
    match path {
        "/token" => "token",
        "/metrics" => "metrics",
        p if p == "/ui" || p.starts_with("/ui/") => "web",
        p => match parse_route(p) {
            Some(Ok(r)) => r.class(),
            Some(Err(_)) | None => "other",
        },
    }
}

impl Server {
    /// A `/v2/` request: its route parsed, its caller identified and checked for the access
    /// the route needs, then handed to the route's handler.
    pub(super) async fn handle(
        &self,
        method: Method,
        uri: Uri,
        headers: HeaderMap,
        body: Body,
        client: Option<std::net::IpAddr>,
    ) -> Result<Response, ApiError> {
        let route = match parse_route(uri.path()) {
            Some(r) => r?,
            None => return Err(ApiError::not_found(Code::Unsupported, format!("no such endpoint {}", uri.path()))),
        };
        let id = self.identify(&uri, &headers, client).await?;
        use Route as R;
        let need = route.action(&method)?;
        let repo = match &route {
            R::Base | R::Catalog => None,
            R::Blob(r, _) | R::Manifest(r, _) | R::Tags(r) | R::Referrers(r, _) | R::UploadStart(r) | R::Upload(r, _) => Some(r),
        };
        if let (Some(repo), Some(action)) = (repo, need) {
            self.authorize(&id, &uri, &headers, repo, action)?;
        }
        let q = query(&uri);
        let head = method == Method::HEAD;
        let body = stall_limited(body.into_data_stream(), self.cfg.limits.idle_timeout, self.metrics.clone());
        let counted = count_bytes(body, self.metrics.clone(), true);
        match (route, method) {
            (R::Base, _) => {
                if self.cfg.auth.is_some() && id == Identity::Anonymous {
                    return Err(ApiError::new(StatusCode::UNAUTHORIZED, Code::Unauthorized, "authentication required")
                        .with_header(header::WWW_AUTHENTICATE, self.challenge(&uri, &headers, None, false)));
                }
                Ok(respond(StatusCode::OK, &[(header::CONTENT_TYPE, "application/json".into())], Body::from("{}")))
            }
            (R::Catalog, _) => self.catalog_page(&id, &uri, &headers, &q, head).await,
            (R::Blob(repo, d), Method::GET | Method::HEAD) => self.get_blob(&repo, &d, &headers, head).await,
            (R::Blob(repo, d), Method::DELETE) => self.delete_blob(&repo, &d).await,
            (R::Manifest(repo, r), Method::GET | Method::HEAD) => self.get_manifest(&repo, &r, &headers, head).await,
            (R::Manifest(repo, r), Method::PUT) => self.put_manifest(&repo, &r, &headers, counted).await,
            (R::Manifest(repo, r), Method::DELETE) => self.delete_manifest(&repo, &r).await,
            (R::Tags(repo), _) => self.tags(&repo, &q).await,
            (R::Referrers(repo, d), _) => self.referrers(&repo, &d, &q).await,
            (R::UploadStart(repo), Method::POST) => self.start_upload(&repo, &q, &id, counted).await,
            (R::Upload(repo, uid), Method::GET) => self.upload_status(&repo, &uid).await,
            (R::Upload(repo, uid), Method::PATCH) => self.patch_upload(&repo, &uid, &headers, counted).await,
            (R::Upload(repo, uid), Method::PUT) => self.finish_upload(&repo, &uid, &q, counted).await,
            (R::Upload(repo, uid), Method::DELETE) => self.cancel_upload(&repo, &uid).await,
            (_, method) => Err(ApiError::new(StatusCode::METHOD_NOT_ALLOWED, Code::Unsupported, format!("{method} not allowed here"))),
        }
    }
}

/// Every `/v2/` request: [`Server::handle`]'s answer, or its error as the API's JSON error
/// (counted, and sent after the rest of the request body is read).
pub(super) async fn v2(State(s): State<Arc<Server>>, client: Client, method: Method, uri: Uri, headers: HeaderMap, body: Body) -> Response {
    let (body, shared) = drain::Shared::new(body);
    match s.handle(method, uri, headers.clone(), body, client_ip(client)).await {
        Ok(r) => r,
        Err(e) => {
            // Read what the client is still sending before answering (server::drain).
            shared.drain(&headers, s.cfg.limits.idle_timeout).await;
            s.metrics.error(e.code.as_str());
            if e.status.is_server_error() {
                crate::access::note_error(&e.message);
            }
            let mut r = e.into_response();
            r.headers_mut().insert(HeaderName::from_static(API_VERSION.0), HeaderValue::from_static(API_VERSION.1));
            r
        }
    }
}

/// Middleware: count requests by method and status, time them by route class, and log
/// them ([`crate::access`]).
pub(super) async fn count(State(s): State<Arc<Server>>, req: Request, next: Next) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let t = std::time::Instant::now();
    let resp = crate::access::logged(req, |req| next.run(req)).await;
    s.metrics.request(method.as_str(), resp.status().as_u16());
    s.metrics.request_latency(route_class(&path), method.as_str(), t.elapsed());
    resp
}
