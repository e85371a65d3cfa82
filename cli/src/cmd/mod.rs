//! One module per subcommand.

pub mod common;
pub mod diff;
pub mod gc;
pub mod inspect;
pub mod pack;
pub mod sample;
pub mod serve;
pub mod unpack;
pub mod verify;
