//! `kedge serve` (a thin call into `kedge_serve`, which runs the services: see
//! docs/ARCHITECTURE.md "Map of the house"), `kedge layout` and `kedge mock-llm`.

use std::process::ExitCode;

#[cfg(feature = "mock-llm")]
use anyhow::Context;
use kedge_runtime::{Config, Runtime};
use kedge_serve::{Service, serve, shutdown_signal};

/// `kedge serve`.
pub(super) async fn serve_command(
    config: Config,
    services: &[Service],
) -> anyhow::Result<ExitCode> {
    // Bound before anything else: a port that is taken stops the process at once.
    if let Some(addr) = &config.metrics_addr {
        kedge_runtime::metrics::start(addr).await?;
    }
    let rt = Runtime::connect(config).await?;
    serve(rt, services, shutdown_signal()).await?;
    Ok(ExitCode::SUCCESS)
}

/// `kedge layout`.
pub(super) async fn layout(config: Config) -> anyhow::Result<ExitCode> {
    let rt = Runtime::connect(config).await?;
    println!(
        "layout ok on nats-server {}",
        rt.client.server_info().version
    );
    Ok(ExitCode::SUCCESS)
}

/// `kedge mock-llm`.
#[cfg(feature = "mock-llm")]
pub(super) async fn mock_llm(
    port: u16,
    script: Option<std::path::PathBuf>,
) -> anyhow::Result<ExitCode> {
    let text = match &script {
        Some(p) => std::fs::read_to_string(p).with_context(|| format!("read {}", p.display()))?,
        None => crate::demo::SCRIPT.to_owned(),
    };
    let scripts = kedge_mock_llm::Scripts::from_json(&text)?;
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    println!("mock-llm listening on http://{}", listener.local_addr()?);
    kedge_mock_llm::serve(
        listener,
        kedge_mock_llm::MockLlm::new(scripts),
        shutdown_signal(),
    )
    .await?;
    Ok(ExitCode::SUCCESS)
}
