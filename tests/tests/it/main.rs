//! All of snapctl's cross-crate integration tests, in one binary.

mod format;
mod registry;
