//! `kedge`: runs any subset of Kedge's services in one process, and the CLI to submit, watch,
//! inspect and steer runs. Every subcommand is a thin shell over the library crates.

mod cli;
mod demo;
mod local_nats;
mod nats_config;
mod timeline;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let args = cli::Cli::parse();
    init_tracing(&args);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kedge: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(cli::run(args)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kedge: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn init_tracing(args: &cli::Cli) {
    use tracing_subscriber::EnvFilter;
    let default = match &args.command {
        cli::Command::Demo(_) | cli::Command::Mcp(_) => "warn",
        // rmcp logs every session's start and end at info.
        _ => "info,rmcp=warn",
    };
    let filter = EnvFilter::try_from_env("KEDGE_LOG").unwrap_or_else(|_| EnvFilter::new(default));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if args.log_json {
        builder.json().init();
    } else {
        builder.init();
    }
}
