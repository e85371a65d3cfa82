//! The OCI Distribution (v1.1) server: one job, storing blobs content-addressed over a
//! blob-store trait (local disk by default, object storage for scale-out) and serving
//! them on the `/v2/` API. The client end, which `push`, `pull`, `copy` and lazy restore
//! use to talk to this or any other OCI registry, is the `regclient` crate.
//!
//! Layers, bottom up:
//! ```text
//! store/     BlobStore trait: FsStore (dir), ObjectStoreBackend (S3), MeteredStore
//! layout     storage keys: blobs/, repositories/<name>/{_layers,_manifests,_tags,_referrers}, _uploads/
//! upload     resumable upload sessions persisted in the store
//! auth       htpasswd users, ACL, docker token flow (HMAC-signed tokens)
//! catalog    which repositories the store holds, paged in order (/v2/_catalog, web view)
//! server     axum routes for the /v2/ API, /token, /metrics
//! access     the request log (client, user, user agent, bytes, status, cause of a 5xx)
//! reload     htpasswd changes taken while serving (polled, or on SIGHUP)
//! stats      the store's totals (bytes, blobs, manifests, dedup), scanned in the background
//! pulls      when manifests were last pulled (in memory, written in batches)
//! signed     signatures stored beside a manifest and whether trusted keys verify them
//! restore_lease  what a restore tells the server: its reads are pulls (Snapctl-Purpose), its lease
//! retention  which tags and manifests gc keeps: policies, snapshot chains, referrers
//! gc         retention, then mark and sweep of unreachable blobs
//! config     serve's and gc's configuration: the TOML file, the flags over it, the defaults
//! units      durations and sizes as the configuration file writes them, and their bounds
//! inuse      what live requests rely on, so a running gc keeps it
//! ```
//! The wire and storage formats are specified in `spec/registry.md`.

pub mod access;
pub mod auth;
pub mod catalog;
pub mod config;
pub mod error;
pub mod gc;
pub mod inuse;
pub mod layout;
pub mod metrics;
pub mod name;
pub mod pulls;
pub mod refs;
pub mod reload;
pub mod restore_lease;
pub mod retention;
pub mod server;
pub mod signed;
pub mod stats;
pub mod store;
pub mod units;
pub mod upload;

pub use name::{RepoName, Tag};
pub use server::{Config, Server};
pub use store::{BlobStore, StoreError};
