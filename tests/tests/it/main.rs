//! All of snapctl's cross-crate integration tests, in one binary.

mod cli;
mod credentials;
mod criu;
mod fault_proxy;
mod format;
mod lazy;
mod lazy_criu;
mod pull;
mod push;
mod registry;
mod runsc;
mod slices;
mod snapshot_registry;
mod vectors;
