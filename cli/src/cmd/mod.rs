//! One module per subcommand.

pub mod cache;
pub mod common;
pub mod copy;
pub mod delete;
pub mod diff;
pub mod gc;
pub mod generate;
pub mod inspect;
pub mod lazy;
pub mod login;
pub mod ls;
pub mod mount;
pub mod pack;
pub mod policy;
pub mod pull;
pub mod push;
pub mod sample;
pub mod serve;
pub mod sign;
pub mod tag;
pub mod unpack;
pub mod verify;
