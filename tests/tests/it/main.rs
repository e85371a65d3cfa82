//! All of snapctl's cross-crate integration tests, in one binary.

mod format;
mod lazy;
mod pull;
mod registry;
mod snapshot_registry;
mod vectors;
