//! An OCI Distribution (v1.1) server that stores blobs content-addressed over a
//! blob-store trait: local disk by default, object storage for scale-out.
//!
//! Filled in by the registry issue; see `spec/registry.md`.
