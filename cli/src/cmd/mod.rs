//! One module per subcommand.

pub mod gc;
pub mod serve;
