//! All of snapctl's cross-crate integration tests, in one binary.

mod adversarial_client;
mod adversarial_files;
mod adversarial_lazy;
mod adversarial_registry;
mod chain;
mod cli;
mod credentials;
mod criu;
mod fault_proxy;
mod format;
mod lazy;
mod lazy_criu;
mod netem;
mod operator;
mod pull;
mod push;
mod registry;
mod runsc;
mod sign;
mod slices;
mod snapshot_registry;
mod vectors;
