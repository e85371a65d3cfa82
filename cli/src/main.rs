//! `snapctl`: the CLI definition plus glue. Each subcommand lives in `cmd/`.
//!
//! Exit codes: 0 ok · 1 verification said no · 2 error (could not answer).

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod cmd;

/// Store, move and serve checkpoint images of sandboxes and microVMs.
///
/// Images are OCI artifacts: chunked, hash-verified, content-addressed. References are
/// `oci:PATH[:TAG]` for a local OCI image layout, `HOST[:PORT]/REPO[:TAG|@DIGEST]` for a
/// repository in any OCI registry (read commands).
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
    Pack(cmd::pack::PackArgs),
    Unpack(cmd::unpack::UnpackArgs),
    Verify(cmd::verify::VerifyArgs),
    Inspect(cmd::inspect::InspectArgs),
    Diff(cmd::diff::DiffArgs),
    Serve(cmd::serve::ServeArgs),
    Sample(cmd::sample::SampleArgs),
    Gc(cmd::gc::GcArgs),
    Pull(cmd::pull::PullArgs),
    Push(cmd::push::PushArgs),
    Copy(cmd::copy::CopyArgs),
    Login(cmd::login::LoginArgs),
    Logout(cmd::login::LogoutArgs),
    Lazy(cmd::lazy::LazyArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Pack(a) => cmd::pack::run(a),
        Command::Unpack(a) => cmd::unpack::run(a),
        Command::Verify(a) => cmd::verify::run(a),
        Command::Inspect(a) => cmd::inspect::run(a),
        Command::Diff(a) => cmd::diff::run(a),
        Command::Sample(a) => cmd::sample::run(a),
        Command::Serve(a) => cmd::serve::run(a),
        Command::Gc(a) => cmd::gc::run(a),
        Command::Pull(a) => cmd::pull::run(a),
        Command::Push(a) => cmd::push::run(a),
        Command::Copy(a) => cmd::copy::run(a),
        Command::Login(a) => cmd::login::run_login(a),
        Command::Logout(a) => cmd::login::run_logout(a),
        Command::Lazy(a) => cmd::lazy::run(a),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("snapctl: {e:#}");
            ExitCode::from(cmd::common::exit_code_for(&e))
        }
    }
}
