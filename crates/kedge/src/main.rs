//! `kedge`: runs any subset of Kedge's services in one process, and the CLI to submit, watch,
//! inspect and steer runs. Every subcommand is a thin shell over the library crates.

mod cli;
#[cfg(feature = "mock-llm")]
mod demo;
#[cfg(feature = "mock-llm")]
mod local_nats;
mod nats_config;
mod timeline;

use std::process::ExitCode;

use clap::Parser;

/// mimalloc instead of glibc malloc (see Cargo.toml): the services allocate per message.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let args = cli::Cli::parse();
    let traces = init_tracing(&args);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        // Its threads yield the cores to the light lane's (docs/ARCHITECTURE.md "Fairness
        // across tenants").
        .on_thread_unpark(kedge_runtime::lower_shared_thread)
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kedge: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let code = match runtime.block_on(cli::run(args)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kedge: {e:#}");
            ExitCode::FAILURE
        }
    };
    if let Some(provider) = traces {
        // Exports the spans still batched; bounded, so an unreachable collector cannot hold
        // the exit up.
        if let Err(e) = provider.shutdown_with_timeout(std::time::Duration::from_secs(5)) {
            eprintln!("kedge: exporting the last trace spans: {e}");
        }
    }
    code
}

/// The one subscriber: an env filter (`KEDGE_LOG`), log lines on stderr (JSON with
/// `--log-json`), and, for `kedge serve` with `otlp_endpoint` set, the OpenTelemetry layer that
/// exports every span over OTLP/HTTP (JSON). Returns the tracer provider to flush at exit.
fn init_tracing(args: &cli::Cli) -> Option<opentelemetry_sdk::trace::SdkTracerProvider> {
    use tracing_subscriber::layer::{Layer, SubscriberExt};
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::{EnvFilter, Registry, filter::Targets};
    let quiet = match &args.command {
        #[cfg(feature = "mock-llm")]
        cli::Command::Demo(_) => true,
        cli::Command::Mcp(_) => true,
        _ => false,
    };
    // rmcp logs every session's start and end at info.
    let default = if quiet { "warn" } else { "info,rmcp=warn" };
    let filter = EnvFilter::try_from_env("KEDGE_LOG").unwrap_or_else(|_| EnvFilter::new(default));
    let lines: Box<dyn Layer<Registry> + Send + Sync> = if args.log_json {
        tracing_subscriber::fmt::layer()
            .json()
            .with_writer(std::io::stderr)
            .boxed()
    } else {
        tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .boxed()
    };
    // Only the services export; a configuration that does not load is reported by the command.
    let endpoint = match &args.command {
        cli::Command::Serve { .. } => cli::config(args).ok().and_then(|c| c.otlp_endpoint),
        _ => None,
    };
    let provider = endpoint.and_then(|endpoint| match otlp_provider(&endpoint) {
        Ok(provider) => Some(provider),
        Err(e) => {
            eprintln!("kedge: not exporting traces to {endpoint}: {e}");
            None
        }
    });
    // Kedge's own spans at info and above, whatever KEDGE_LOG says of the log lines.
    let otel = provider.as_ref().map(|provider| {
        use opentelemetry::trace::TracerProvider;
        tracing_opentelemetry::layer()
            .with_tracer(provider.tracer("kedge"))
            .with_filter(Targets::new().with_target("kedge", tracing::Level::INFO))
    });
    if provider.is_some() {
        kedge_runtime::trace::set_exporting();
    }
    tracing_subscriber::registry()
        .with(lines.with_filter(filter))
        .with(otel)
        .init();
    provider
}

/// A tracer provider that batches spans (on the SDK's own thread) to `<endpoint>/v1/traces`.
fn otlp_provider(
    endpoint: &str,
) -> Result<opentelemetry_sdk::trace::SdkTracerProvider, opentelemetry_otlp::ExporterBuildError> {
    use opentelemetry_otlp::WithExportConfig;
    // The exporter's HTTP client (reqwest 0.13 without a TLS provider of its own, see
    // Cargo.toml) takes the process's default; one already installed is as good.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(opentelemetry_otlp::Protocol::HttpJson)
        .with_endpoint(format!("{}/v1/traces", endpoint.trim_end_matches('/')))
        .build()?;
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name("kedge")
        .build();
    Ok(opentelemetry_sdk::trace::SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource)
        .build())
}
