//! `snapctl`: the CLI definition plus glue. Each subcommand lives in `cmd/`.
//!
//! Exit codes: 0 ok · 1 verification said no · 2 error (could not answer).

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod cmd;

/// Store, move and serve checkpoint images of sandboxes and microVMs.
///
/// Images are OCI artifacts: chunked, hash-verified, content-addressed. References are
/// `oci:PATH[:TAG]` for a local OCI image layout.
///
/// Exit codes: 0 ok, 1 verification failed, 2 error.
#[derive(Debug, Parser)]
#[command(name = "snapctl", version, max_term_width = 100)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    Serve(cmd::serve::ServeArgs),
    Gc(cmd::gc::GcArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(a) => cmd::serve::run(a),
        Command::Gc(a) => cmd::gc::run(a),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("snapctl: {e:#}");
            ExitCode::from(2)
        }
    }
}
