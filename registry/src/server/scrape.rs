//! `/metrics`, the Prometheus text: on the API listener (with auth enabled, for users
//! only, the store's totals only for those who may pull every repository) and on a
//! metrics listener of its own (for anyone who can reach it).

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};

use super::wire::{client_ip, Client};
use super::Server;
use crate::auth::Identity;
use crate::catalog::Readable;
use crate::error::{ApiError, Code};

/// `/metrics` on the API listener: with auth enabled, for users only (a scraper sends
/// Basic credentials); the store's totals only for users who may pull every repository.
pub(super) async fn metrics(State(s): State<Arc<Server>>, client: Client, uri: Uri, headers: HeaderMap) -> Response {
    let mut every_repository = true;
    if s.cfg.auth.is_some() {
        let id = s.identify(&uri, &headers, client_ip(client)).await;
        let user = match &id {
            Ok(Identity::User(_)) => true,
            Ok(Identity::Token { sub, .. }) => !sub.is_empty(),
            _ => false,
        };
        if !user {
            return ApiError::new(StatusCode::UNAUTHORIZED, Code::Unauthorized, "metrics need credentials")
                .with_header(header::WWW_AUTHENTICATE, "Basic realm=\"snapctl\"")
                .into_response();
        }
        every_repository = id.ok().and_then(|id| s.readable(&id)) == Some(Readable::All);
    }
    render_metrics(&s, every_repository)
}

/// `/metrics` for anyone who can reach it (the metrics listener).
pub(super) async fn open_metrics(State(s): State<Arc<Server>>) -> Response {
    render_metrics(&s, true)
}

/// The metrics text; with `store_totals`, the store's totals (which tell about every
/// repository) too.
fn render_metrics(s: &Server, store_totals: bool) -> Response {
    let mut text = s.metrics.render();
    if let Some(a) = &s.cfg.auth {
        text.push_str(&crate::metrics::render_auth(&a.stats()));
    }
    if let Some(t) = s.stats.latest().filter(|_| store_totals) {
        text.push_str(&t.render_prometheus());
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}
