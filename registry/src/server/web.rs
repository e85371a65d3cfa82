//! A read-only web view for operators: server-rendered HTML, a few lines of CSS, no
//! script. Same authentication as the API (Basic credentials or a token; a visitor without
//! them gets the API's 401 challenge and a body that names nothing stored).
//!
//! ```text
//! /ui/                                     store totals, repositories (pages of 100) with their own
//!                                          and shared bytes (last scan)
//! /ui/repo/<name>                          its tags (pages of 50): digest, type, kind, its own
//!                                          bytes and with what it inherits, pushed, last pulled
//!                                          (a cosign `sha256-<hex>.sig` tag shown as the signature
//!                                          of its subject); and up to 50 of its manifests
//! /ui/repo/<name>/_manifest/<digest>       one manifest: type, sizes, last pulled, layers (up to
//!                                          200), for a snapctl snapshot its kind, logical and
//!                                          stored bytes, chain depth and parents; its signatures
//!                                          (tag scheme and referrers: key fingerprint, verified
//!                                          by a `--trusted-key` or not); referrers (up to 100)
//! /ui/retention                            what retention would delete now (a dry run of gc with
//!                                          the server's policies; at most one a minute, shared),
//!                                          in the repositories the visitor may pull
//! ```
//! Pull times are those written to the store (`_pulled`) and those this server recorded
//! and has not written yet.
//! Every page does a bounded amount of work: lists are paged or capped, manifests and
//! configs are read only up to their size limits, and a chain is followed at most
//! [`imgfmt::config::MAX_CHAIN_DEPTH`] links and [`CHAIN_BYTES`] of configs. Every name,
//! tag, digest and annotation is HTML-escaped.

use std::fmt::Write as _;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use imgfmt::size::human;
use imgfmt::OciDigest;

use super::wire::{client_ip, param, query, Client};
use super::Server;
use crate::auth::{Action, Identity};
use crate::catalog::Readable;
use crate::layout;
use crate::name::{RepoName, Tag};
use crate::store::{BlobStore, StoreError};

/// Repositories per index page.
const REPOS_PER_PAGE: usize = 100;
/// Tags per repository page (each costs two small reads).
const TAGS_PER_PAGE: usize = 50;
/// Untagged manifests shown on a repository page.
const MANIFESTS_SHOWN: usize = 50;
/// Layers shown on a manifest page.
const LAYERS_SHOWN: usize = 200;
/// Referrers shown on a manifest page.
const REFERRERS_SHOWN: usize = 100;
/// Most bytes of parent configs read to draw one chain.
const CHAIN_BYTES: u64 = 32 << 20;
/// Largest manifest read (the registry's default limit).
const MAX_MANIFEST: u64 = super::DEFAULT_MAX_MANIFEST as u64;

const CSS: &str = "body{font:14px/1.4 system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse;margin:.5em 0 1.5em}\
td,th{border-bottom:1px solid #ddd;padding:.25em .8em;text-align:left;vertical-align:top}th{background:#f4f4f4}\
code{font:12px ui-monospace,monospace}.num{text-align:right}nav a{margin-right:1em}";

/// HTML-escape text for element content and quoted attributes.
pub fn esc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&#39;"),
            c => o.push(c),
        }
    }
    o
}

/// A query-string value, percent-encoded.
fn q(s: &str) -> String {
    form_urlencoded::byte_serialize(s.as_bytes()).collect()
}

fn time(t: std::time::SystemTime) -> String {
    let secs = t.duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
    time::OffsetDateTime::from_unix_timestamp(secs)
        .ok()
        .and_then(|t| t.format(&time::format_description::well_known::Rfc3339).ok())
        .unwrap_or_else(|| "-".into())
}

fn page(status: StatusCode, title: &str, body: &str) -> Response {
    let html = format!(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>{} · snapctl</title><style>{CSS}</style></head><body><nav><a href=\"/ui/\">snapctl registry</a></nav><h1>{}</h1>{body}</body></html>",
        esc(title),
        esc(title)
    );
    let mut r = (status, html).into_response();
    r.headers_mut().insert(header::CONTENT_TYPE, header::HeaderValue::from_static("text/html; charset=utf-8"));
    // Pages are read-only and name nothing of another origin.
    r.headers_mut()
        .insert(header::HeaderName::from_static("content-security-policy"), header::HeaderValue::from_static("default-src 'none'; style-src 'unsafe-inline'"));
    r
}

/// `/ui` → `/ui/`.
pub(super) async fn root() -> Response {
    (StatusCode::PERMANENT_REDIRECT, [(header::LOCATION, "/ui/")]).into_response()
}

/// `/ui/` and below.
pub(super) async fn ui(State(s): State<Arc<Server>>, client: Client, uri: Uri, headers: HeaderMap) -> Response {
    match serve(&s, &uri, &headers, client_ip(client)).await {
        Ok(r) => r,
        Err(e) => e,
    }
}

/// Who asks, or the answer that they may not.
async fn who(s: &Server, uri: &Uri, headers: &HeaderMap, client: Option<std::net::IpAddr>) -> Result<Identity, Response> {
    let id = s.identify(uri, headers, client).await.map_err(|e| denied(s, uri, headers, e.status))?;
    Ok(id)
}

/// 401 (with the API's challenge, and Basic for browsers) or 403, naming nothing.
fn denied(s: &Server, uri: &Uri, headers: &HeaderMap, status: StatusCode) -> Response {
    let mut r = page(status, if status == StatusCode::FORBIDDEN { "Forbidden" } else { "Authentication required" }, "<p>Log in to see this registry.</p>");
    if status == StatusCode::UNAUTHORIZED && s.cfg.auth.is_some() {
        let h = r.headers_mut();
        if let Ok(v) = header::HeaderValue::from_str(&s.challenge(uri, headers, None, false)) {
            h.append(header::WWW_AUTHENTICATE, v);
        }
        // A browser answers only a Basic challenge; API clients take the Bearer one.
        h.append(header::WWW_AUTHENTICATE, header::HeaderValue::from_static("Basic realm=\"snapctl\""));
    }
    r
}

fn not_found() -> Response {
    page(StatusCode::NOT_FOUND, "Not found", "<p>No such page.</p>")
}

fn failed(e: StoreError) -> Response {
    tracing::error!(%e, "web view: storage");
    crate::access::note_error(&e.to_string());
    page(StatusCode::INTERNAL_SERVER_ERROR, "Storage error", "<p>The store could not be read; see the server's log.</p>")
}

async fn serve(s: &Server, uri: &Uri, headers: &HeaderMap, client: Option<std::net::IpAddr>) -> Result<Response, Response> {
    let id = who(s, uri, headers, client).await?;
    let rest = uri.path().strip_prefix("/ui/").ok_or_else(not_found)?;
    let qs = query(uri);
    if rest.is_empty() {
        let readable = s.readable(&id).ok_or_else(|| denied(s, uri, headers, StatusCode::UNAUTHORIZED))?;
        return index(s, &readable, param(&qs, "last")).await.map_err(failed);
    }
    if rest == "retention" {
        s.readable(&id).ok_or_else(|| denied(s, uri, headers, StatusCode::UNAUTHORIZED))?;
        return retention_page(s, &id).await.map_err(|e| match e {
            crate::gc::GcError::Store(e) => failed(e),
            e => {
                tracing::error!(%e, "web view: retention dry run");
                page(StatusCode::INTERNAL_SERVER_ERROR, "Retention", &format!("<p>The dry run failed: {}</p>", esc(&e.to_string())))
            }
        });
    }
    let rest = rest.strip_prefix("repo/").ok_or_else(not_found)?;
    let (name, digest) = match rest.split_once("/_manifest/") {
        Some((n, d)) => (n, Some(d)),
        None => (rest, None),
    };
    let repo = RepoName::parse(name).map_err(|_| not_found())?;
    if !s.may(&id, &repo, Action::Pull) {
        // Anonymous: the challenge; a user without the right: 403. Neither says whether
        // the repository exists.
        let status = if matches!(id, Identity::Anonymous) { StatusCode::UNAUTHORIZED } else { StatusCode::FORBIDDEN };
        return Err(denied(s, uri, headers, status));
    }
    match digest {
        None => repository(s, &repo, param(&qs, "last")).await.map_err(failed)?.ok_or_else(not_found),
        Some(d) => {
            let d: OciDigest = d.parse().map_err(|_| not_found())?;
            manifest_page(s, &repo, &d).await.map_err(failed)?.ok_or_else(not_found)
        }
    }
}

async fn index(s: &Server, readable: &Readable, last: Option<&str>) -> Result<Response, StoreError> {
    let mut b = String::new();
    b.push_str("<h2>Store</h2>");
    match s.stats.latest() {
        // Totals are of every repository: only for who may read them all.
        _ if *readable != Readable::All => b.push_str("<p>The store's totals are shown to users who may pull every repository.</p>"),
        Some(t) => {
            let _ = write!(
                b,
                "<table><tr><th>stored bytes</th><td class=num>{}</td></tr><tr><th>logical bytes</th><td class=num>{}</td></tr>\
                 <tr><th>dedup ratio</th><td class=num>{:.2}</td></tr><tr><th>blobs</th><td class=num>{}</td></tr>\
                 <tr><th>manifests</th><td class=num>{}</td></tr><tr><th>repositories</th><td class=num>{}</td></tr>\
                 <tr><th>taken</th><td>{} ({} ms)</td></tr></table>",
                human(t.stored_bytes),
                human(t.logical_bytes),
                t.dedup_ratio(),
                t.blobs,
                t.manifests,
                t.repositories,
                time(std::time::UNIX_EPOCH + std::time::Duration::from_secs(t.scanned_at)),
                t.scan_ms
            );
        }
        None => b.push_str("<p>Not taken yet (the server scans the store every <code>--stats-interval</code>).</p>"),
    }
    let p = s.catalog.page(last, REPOS_PER_PAGE, readable).await?;
    b.push_str("<p><a href=\"/ui/retention\">What retention would delete now</a></p><h2>Repositories</h2>");
    if p.repos.is_empty() {
        b.push_str("<p>None.</p>");
    } else {
        let bytes: std::collections::HashMap<String, (u64, u64)> =
            s.stats.latest().and_then(|t| t.repository_bytes).unwrap_or_default().into_iter().map(|r| (r.repository, (r.own_bytes, r.shared_bytes))).collect();
        b.push_str("<table><tr><th>repository</th><th>own bytes</th><th>shared bytes</th></tr>");
        for r in &p.repos {
            let (own, shared) = match bytes.get(r.as_str()) {
                Some((o, sh)) => (human(*o), human(*sh)),
                None => ("-".into(), "-".into()),
            };
            let _ = write!(b, "<tr><td><a href=\"/ui/repo/{0}\">{0}</a></td><td class=num>{own}</td><td class=num>{shared}</td></tr>", esc(r.as_str()));
        }
        b.push_str("</table><p>Own bytes: blobs no other repository links (what deleting the repository frees); shared: blobs other repositories link too. As of the last scan.</p>");
    }
    if let (true, Some(end)) = (p.more, p.repos.last()) {
        let _ = write!(b, "<p><a rel=next href=\"/ui/?last={}\">next page</a></p>", esc(&q(end.as_str())));
    }
    Ok(page(StatusCode::OK, "Registry", &b))
}

/// A manifest's JSON, if it is stored and within the size limit.
async fn read_json(store: &dyn BlobStore, d: &OciDigest, max: u64) -> Result<Option<serde_json::Value>, StoreError> {
    let key = layout::blob(d);
    match store.head(&key).await {
        Ok(m) if m.size <= max => {}
        Ok(_) => return Ok(None),
        Err(e) if e.is_not_found() => return Ok(None),
        Err(e) => return Err(e),
    }
    match store.get_bytes(&key).await {
        Ok(b) => Ok(serde_json::from_slice(&b).ok()),
        Err(e) if e.is_not_found() => Ok(None),
        Err(e) => Err(e),
    }
}

fn kind_of(m: &serde_json::Value) -> String {
    m.pointer("/annotations/dev.snapctl.kind").and_then(|v| v.as_str()).unwrap_or("-").to_owned()
}

fn type_of(m: &serde_json::Value) -> String {
    if crate::signed::is_signature(m) {
        return "signature (cosign)".into();
    }
    m.get("artifactType").or_else(|| m.pointer("/config/mediaType")).or_else(|| m.get("mediaType")).and_then(|v| v.as_str()).unwrap_or("-").to_owned()
}

async fn repository(s: &Server, repo: &RepoName, last: Option<&str>) -> Result<Option<Response>, StoreError> {
    let store = s.store.as_ref();
    let tags_dir = layout::tags_dir(repo);
    let after = last.and_then(|l| Tag::parse(l).ok()).map(|t| layout::tag(repo, &t));
    let tags = store.list_after(&tags_dir, after.as_deref(), TAGS_PER_PAGE + 1).await?;
    let manifests = store.list_after(&layout::manifests_dir(repo), None, MANIFESTS_SHOWN + 1).await?;
    if tags.is_empty() && manifests.is_empty() && last.is_none() {
        return Ok(None);
    }
    let r = esc(repo.as_str());
    let mut b = String::new();
    let pulled = pulled(s, repo).await?;
    b.push_str("<h2>Tags</h2><table><tr><th>tag</th><th>manifest</th><th>type</th><th>kind</th><th>own bytes</th><th>with inherited</th><th>pushed</th><th>last pulled</th></tr>");
    for t in tags.iter().take(TAGS_PER_PAGE) {
        let Some(tag) = t.key.rsplit('/').next() else { continue };
        let Ok(raw) = store.get_bytes(&t.key).await else { continue };
        let Ok(d) = String::from_utf8_lossy(&raw).trim().parse::<OciDigest>() else { continue };
        let pushed = match store.head(&layout::manifest_link(repo, &d)).await {
            Ok(m) => time(m.modified),
            Err(_) => "-".into(),
        };
        let m = read_json(store, &d, MAX_MANIFEST).await?.unwrap_or_default();
        let (own, all) = own_and_all(&m);
        let what = match crate::signed::tag_subject(tag) {
            Some(subject) => format!("signature (cosign) of <a href=\"/ui/repo/{r}/_manifest/{subject}\"><code>{}</code></a>", esc(&short(&subject))),
            None => esc(&type_of(&m)),
        };
        let _ = write!(
            b,
            "<tr><td>{}</td><td><a href=\"/ui/repo/{r}/_manifest/{d}\"><code>{}</code></a></td><td>{what}</td><td>{}</td><td class=num>{}</td><td class=num>{}</td><td>{pushed}</td><td>{}</td></tr>",
            esc(tag),
            esc(&short(&d)),
            esc(&kind_of(&m)),
            human(own),
            human(all),
            pulled_text(&pulled, &d)
        );
    }
    b.push_str("</table>");
    if tags.len() > TAGS_PER_PAGE {
        if let Some(end) = tags.get(TAGS_PER_PAGE - 1).and_then(|m| m.key.rsplit('/').next()) {
            let _ = write!(b, "<p><a rel=next href=\"/ui/repo/{r}?last={}\">more tags</a></p>", esc(&q(end)));
        }
    }
    b.push_str("<h2>Manifests</h2><ul>");
    for m in manifests.iter().take(MANIFESTS_SHOWN) {
        if let Some(layout::RepoKey::Manifest(_, d)) = layout::parse_repo_key(&m.key) {
            let _ = write!(b, "<li><a href=\"/ui/repo/{r}/_manifest/{d}\"><code>{d}</code></a> pushed {}</li>", time(m.modified));
        }
    }
    b.push_str("</ul>");
    if manifests.len() > MANIFESTS_SHOWN {
        let _ = write!(b, "<p>Only the first {MANIFESTS_SHOWN} manifests are shown.</p>");
    }
    Ok(Some(page(StatusCode::OK, repo.as_str(), &b)))
}

/// The page of manifest `d` in `repo`: its summary, snapshot rows, layers and referrers.
async fn manifest_page(s: &Server, repo: &RepoName, d: &OciDigest) -> Result<Option<Response>, StoreError> {
    let store = s.store.as_ref();
    let link = match store.head(&layout::manifest_link(repo, d)).await {
        Ok(m) => m,
        Err(e) if e.is_not_found() => return Ok(None),
        Err(e) => return Err(e),
    };
    let size = store.head(&layout::blob(d)).await.map(|m| m.size).unwrap_or(0);
    let m = read_json(store, d, MAX_MANIFEST).await?.unwrap_or_default();
    let r = esc(repo.as_str());
    let layers: Vec<serde_json::Value> = m.get("layers").and_then(|l| l.as_array()).cloned().unwrap_or_default();
    let own: u64 = layers.iter().filter(|l| layer_owner(l) == "self").map(layer_size).sum();
    let all: u64 = layers.iter().map(layer_size).sum();
    let mut b = String::new();
    let _ = write!(
        b,
        "<table><tr><th>digest</th><td><code>{}</code></td></tr><tr><th>media type</th><td>{}</td></tr><tr><th>type</th><td>{}</td></tr>\
         <tr><th>manifest size</th><td class=num>{}</td></tr><tr><th>blobs it lists</th><td class=num>{} in {} layers</td></tr>\
         <tr><th>pushed</th><td>{}</td></tr><tr><th>last pulled</th><td>{}</td></tr>",
        esc(&d.to_string()),
        esc(m.get("mediaType").and_then(|v| v.as_str()).unwrap_or("-")),
        esc(&type_of(&m)),
        human(size),
        human(all),
        layers.len(),
        time(link.modified),
        pulled_text(&pulled(s, repo).await?, d)
    );
    snapshot_rows(store, repo, &m, own, &mut b).await?;
    b.push_str("</table>");
    layers_table(&layers, &mut b);
    signatures_section(store, repo, d, &s.cfg.trusted_keys, &mut b).await?;
    referrers_section(store, repo, d, &mut b).await?;
    let _ = write!(b, "<p><a href=\"/ui/repo/{r}\">{r}</a></p>");
    Ok(Some(page(StatusCode::OK, &format!("{}@{}", repo.as_str(), &d.to_string()[..19.min(d.to_string().len())]), &b)))
}

/// The `dev.snapctl.owner` annotation of a layer descriptor, or "".
fn layer_owner(l: &serde_json::Value) -> String {
    l.pointer("/annotations/dev.snapctl.owner").and_then(|v| v.as_str()).unwrap_or("").to_owned()
}

/// The `size` of a layer descriptor, or 0.
fn layer_size(l: &serde_json::Value) -> u64 {
    l.get("size").and_then(|v| v.as_u64()).unwrap_or(0)
}

/// A manifest's bytes (the sizes its descriptors name): its own, without the layers a
/// snapshot inherits (`dev.snapctl.owner` other than `self`), and all of them.
fn own_and_all(m: &serde_json::Value) -> (u64, u64) {
    let all = crate::stats::descriptor_sizes(&serde_json::to_vec(m).unwrap_or_default());
    let layers = m.get("layers").and_then(|l| l.as_array()).map(Vec::as_slice).unwrap_or_default();
    let inherited: u64 = layers.iter().filter(|l| !matches!(layer_owner(l).as_str(), "" | "self")).map(layer_size).sum();
    (all.saturating_sub(inherited), all)
}

/// The first 19 characters of a digest (`sha256:` and 12 hex digits).
fn short(d: &OciDigest) -> String {
    d.to_string().chars().take(19).collect()
}

/// The summary rows of a snapctl snapshot (manifest `m`, whose own blobs hold `own` bytes):
/// kind, creation, files, sizes, chain depth and parents (linked when `repo` has them).
/// Nothing for a manifest whose config is not a snapctl config, or cannot be read.
async fn snapshot_rows(store: &dyn BlobStore, repo: &RepoName, m: &serde_json::Value, own: u64, b: &mut String) -> Result<(), StoreError> {
    let r = esc(repo.as_str());
    let config = m.pointer("/config/mediaType").and_then(|v| v.as_str()) == Some(imgfmt::media::CONFIG);
    if config {
        if let Some(cd) = m.pointer("/config/digest").and_then(|v| v.as_str()).and_then(|v| v.parse::<OciDigest>().ok()) {
            if let Some(cfg) = read_config(store, &cd).await? {
                let logical: u64 = cfg.files.iter().map(|f| f.size).sum();
                let _ = write!(
                    b,
                    "<tr><th>kind</th><td>{}</td></tr><tr><th>created</th><td>{}</td></tr><tr><th>files</th><td class=num>{}</td></tr>\
                     <tr><th>logical bytes</th><td class=num>{}</td></tr><tr><th>stored bytes (its own blobs)</th><td class=num>{}</td></tr>",
                    esc(&cfg.kind.to_string()),
                    esc(&cfg.created),
                    cfg.files.len(),
                    human(logical),
                    human(own)
                );
                let (depth, parents, cut) = chain(store, &cfg).await?;
                let _ =
                    write!(b, "<tr><th>chain depth</th><td class=num>{depth}{}</td></tr><tr><th>parents</th><td>", if cut { "+ (not all read)" } else { "" });
                if parents.is_empty() {
                    b.push_str("none");
                }
                for p in &parents {
                    let here = store.head(&layout::manifest_link(repo, p)).await.is_ok();
                    if here {
                        let _ = write!(b, "<a href=\"/ui/repo/{r}/_manifest/{p}\"><code>{p}</code></a><br>");
                    } else {
                        let _ = write!(b, "<code>{p}</code> (not in this repository)<br>");
                    }
                }
                b.push_str("</td></tr>");
            }
        }
    }
    Ok(())
}

/// The table of a manifest's `layers` (the first LAYERS_SHOWN of them).
fn layers_table(layers: &[serde_json::Value], b: &mut String) {
    b.push_str("<h2>Layers</h2><table><tr><th>digest</th><th>media type</th><th>owner</th><th>size</th></tr>");
    for l in layers.iter().take(LAYERS_SHOWN) {
        let _ = write!(
            b,
            "<tr><td><code>{}</code></td><td>{}</td><td>{}</td><td class=num>{}</td></tr>",
            esc(l.get("digest").and_then(|v| v.as_str()).unwrap_or("-")),
            esc(l.get("mediaType").and_then(|v| v.as_str()).unwrap_or("-")),
            esc(&layer_owner(l)),
            human(layer_size(l))
        );
    }
    b.push_str("</table>");
    if layers.len() > LAYERS_SHOWN {
        let _ = write!(b, "<p>Only the first {LAYERS_SHOWN} layers are shown.</p>");
    }
}

/// The Signatures section of manifest `d` in `repo` (crate::signed): where each is, its
/// signed name, and who signed it as far as `keys` tell.
async fn signatures_section(store: &dyn BlobStore, repo: &RepoName, d: &OciDigest, keys: &[sign::PublicKey], b: &mut String) -> Result<(), StoreError> {
    let r = esc(repo.as_str());
    b.push_str("<h2>Signatures</h2>");
    let sigs = crate::signed::of(store, repo, d, keys).await?;
    if sigs.is_empty() {
        b.push_str("<p>None.</p>");
        return Ok(());
    }
    b.push_str("<table><tr><th>where</th><th>signed name</th><th>key</th><th>verified</th></tr>");
    for sg in &sigs {
        let (key, verified) = match &sg.verdict {
            crate::signed::Verdict::Verified { key } => (format!("<code>{}</code>", esc(key)), "yes".to_owned()),
            crate::signed::Verdict::NotVerified { reason } => ("-".to_owned(), format!("no: {}", esc(reason))),
            crate::signed::Verdict::Unchecked => ("unknown".to_owned(), "not checked: the server has no trusted key (serve --trusted-key)".to_owned()),
        };
        let _ = write!(
            b,
            "<tr><td><a href=\"/ui/repo/{r}/_manifest/{}\">{}</a></td><td>{}</td><td>{key}</td><td>{verified}</td></tr>",
            sg.manifest,
            esc(&sg.place),
            esc(sg.identity.as_deref().unwrap_or("-"))
        );
    }
    b.push_str("</table>");
    Ok(())
}

/// The Referrers section of manifest `d` in `repo`: the first REFERRERS_SHOWN entries
/// whose descriptor reads, each linked.
async fn referrers_section(store: &dyn BlobStore, repo: &RepoName, d: &OciDigest, b: &mut String) -> Result<(), StoreError> {
    let r = esc(repo.as_str());
    b.push_str("<h2>Referrers</h2>");
    let refs = store.list_after(&layout::referrers_dir(repo, d), None, REFERRERS_SHOWN).await?;
    if refs.is_empty() {
        b.push_str("<p>None.</p>");
    } else {
        b.push_str("<table><tr><th>referrer</th><th>type</th><th>size</th></tr>");
        for k in &refs {
            let Ok(raw) = store.get_bytes(&k.key).await else { continue };
            let Ok(desc) = serde_json::from_slice::<serde_json::Value>(&raw) else { continue };
            let Some(rd) = desc.get("digest").and_then(|v| v.as_str()).and_then(|v| v.parse::<OciDigest>().ok()) else { continue };
            let _ = write!(
                b,
                "<tr><td><a href=\"/ui/repo/{r}/_manifest/{rd}\"><code>{rd}</code></a></td><td>{}</td><td class=num>{}</td></tr>",
                esc(desc.get("artifactType").and_then(|v| v.as_str()).unwrap_or("-")),
                human(desc.get("size").and_then(|v| v.as_u64()).unwrap_or(0))
            );
        }
        b.push_str("</table>");
    }
    Ok(())
}

/// When each manifest of `repo` was last pulled (unix seconds): the store's record, and
/// what this server recorded since it last wrote it.
async fn pulled(s: &Server, repo: &RepoName) -> Result<std::collections::HashMap<OciDigest, u64>, StoreError> {
    let secs = |t: std::time::SystemTime| t.duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let mut m: std::collections::HashMap<OciDigest, u64> = crate::pulls::read(s.store.as_ref(), repo).await?.into_iter().map(|(d, t)| (d, secs(t))).collect();
    for (d, t) in s.pulls.pending_for(repo) {
        let e = m.entry(d).or_insert(0);
        *e = (*e).max(t);
    }
    Ok(m)
}

fn pulled_text(pulled: &std::collections::HashMap<OciDigest, u64>, d: &OciDigest) -> String {
    match pulled.get(d) {
        Some(&t) => time(std::time::UNIX_EPOCH + std::time::Duration::from_secs(t)),
        None => "never (since pulls were recorded)".into(),
    }
}

/// Verdicts shown on the retention page, at most.
const VERDICTS_SHOWN: usize = 500;

/// `/ui/retention`: a dry run of the server's gc (its scheduled policies, else the
/// defaults), computed at most once a minute and shared by every visitor; each sees the
/// verdicts of the repositories they may pull.
async fn retention_page(s: &Server, id: &Identity) -> Result<Response, crate::gc::GcError> {
    let plan = s.retention_preview().await?;
    let mut b = String::new();
    let _ = write!(
        b,
        "<p>A dry run of gc as of {} (delay {} s{}): nothing is deleted by this page. <code>snapctl gc --dry-run --json</code> gives the same verdicts.</p>",
        time(std::time::UNIX_EPOCH + std::time::Duration::from_secs(plan.now)),
        plan.delay_seconds,
        if s.cfg.gc.is_some() { ", the server's policies" } else { ", no scheduled gc: default policy" }
    );
    let visible = |repo: &str| RepoName::parse(repo).is_ok_and(|r| s.may(id, &r, Action::Pull));
    let going: Vec<_> = plan.deleted_manifests().filter(|v| visible(&v.repository)).collect();
    let bytes: u64 = going.iter().map(|v| v.bytes).sum();
    let _ =
        write!(b, "<h2>Manifests that would go</h2><p>{} manifests, {} of blobs of their own (more where they share blobs).</p>", going.len(), human(bytes));
    if !going.is_empty() {
        b.push_str("<table><tr><th>repository</th><th>manifest</th><th>rule</th><th>type</th><th>pushed</th><th>last pulled</th><th>bytes</th><th>shared bytes</th></tr>");
        for v in going.iter().take(VERDICTS_SHOWN) {
            let rule = serde_json::to_value(&v.rule).ok().and_then(|j| j.get("rule").and_then(|r| r.as_str()).map(str::to_owned)).unwrap_or_default();
            let at = |t: Option<u64>| t.map(|t| time(std::time::UNIX_EPOCH + std::time::Duration::from_secs(t))).unwrap_or_else(|| "-".into());
            let _ = write!(
                b,
                "<tr><td>{}</td><td><a href=\"/ui/repo/{}/_manifest/{}\"><code>{}</code></a></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td class=num>{}</td><td class=num>{}</td></tr>",
                esc(&v.repository),
                esc(&v.repository),
                v.digest,
                esc(&v.digest.to_string()[..19.min(v.digest.to_string().len())]),
                esc(&rule),
                esc(v.artifact_type.as_deref().unwrap_or("-")),
                at(v.pushed),
                at(v.pulled),
                human(v.bytes),
                human(v.shared_bytes)
            );
        }
        b.push_str("</table>");
        if going.len() > VERDICTS_SHOWN {
            let _ = write!(b, "<p>Only the first {VERDICTS_SHOWN} are shown.</p>");
        }
    }
    let tags: Vec<_> = plan.tags.iter().filter(|t| t.action == crate::retention::Action::Delete && visible(&t.repository)).collect();
    let _ = write!(b, "<h2>Tags that would go</h2><p>{}.</p>", tags.len());
    if !tags.is_empty() {
        b.push_str("<table><tr><th>repository</th><th>tag</th><th>manifest</th><th>pushed</th></tr>");
        for t in tags.iter().take(VERDICTS_SHOWN) {
            let _ = write!(
                b,
                "<tr><td>{}</td><td>{}</td><td><code>{}</code></td><td>{}</td></tr>",
                esc(&t.repository),
                esc(&t.tag),
                esc(&t.target.to_string()[..19.min(t.target.to_string().len())]),
                time(std::time::UNIX_EPOCH + std::time::Duration::from_secs(t.pushed))
            );
        }
        b.push_str("</table>");
    }
    Ok(page(StatusCode::OK, "Retention", &b))
}

async fn read_config(store: &dyn BlobStore, d: &OciDigest) -> Result<Option<imgfmt::ImageConfig>, StoreError> {
    let key = layout::blob(d);
    match store.head(&key).await {
        Ok(m) if m.size <= imgfmt::config::MAX_CONFIG_BYTES => {}
        Ok(_) => return Ok(None),
        Err(e) if e.is_not_found() => return Ok(None),
        Err(e) => return Err(e),
    }
    match store.get_bytes(&key).await {
        Ok(b) => Ok(imgfmt::ImageConfig::decode(&b).ok()),
        Err(e) if e.is_not_found() => Ok(None),
        Err(e) => Err(e),
    }
}

/// Depth of an image's chain and its parents' manifest digests (nearest first), reading at
/// most [`imgfmt::config::MAX_CHAIN_DEPTH`] configs and [`CHAIN_BYTES`]; `true` when cut short.
async fn chain(store: &dyn BlobStore, cfg: &imgfmt::ImageConfig) -> Result<(usize, Vec<OciDigest>, bool), StoreError> {
    let (mut parents, mut read) = (Vec::new(), 0u64);
    let mut next = cfg.parent.clone();
    while let Some(p) = next.take() {
        parents.push(p.manifest.clone());
        if parents.len() >= imgfmt::config::MAX_CHAIN_DEPTH || parents.iter().filter(|x| **x == p.manifest).count() > 1 {
            return Ok((parents.len(), parents, true));
        }
        let size = match store.head(&layout::blob(&p.config)).await {
            Ok(m) => m.size,
            Err(e) if e.is_not_found() => return Ok((parents.len(), parents, true)),
            Err(e) => return Err(e),
        };
        read += size;
        if read > CHAIN_BYTES {
            return Ok((parents.len(), parents, true));
        }
        match read_config(store, &p.config).await? {
            Some(c) => next = c.parent,
            None => return Ok((parents.len(), parents, true)),
        }
    }
    Ok((parents.len(), parents, false))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_everything_html_treats_specially() {
        assert_eq!(esc("<a href=\"x\">&'</a>"), "&lt;a href=&quot;x&quot;&gt;&amp;&#39;&lt;/a&gt;");
        assert_eq!(human(1536), "1.5 KiB");
        assert_eq!(human(12), "12 B");
    }
}
