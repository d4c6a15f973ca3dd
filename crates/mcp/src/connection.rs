//! One live MCP session: starting it (child process or HTTP), noticing when it dies, ending it.

use std::collections::VecDeque;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use process_wrap::tokio::{CommandWrap, ProcessGroup};
use rmcp::model::{ClientCapabilities, ClientConfig, Implementation, ProtocolVersion};
use rmcp::service::{RoleClient, RunningService, RxJsonRpcMessage, TxJsonRpcMessage};
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::{StreamableHttpClientTransport, TokioChildProcess, Transport};
use rmcp::{Peer, ServiceExt};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::ChildStderr;

use crate::{Launch, Launcher, McpError, ServerConfig};

/// How many of a child's last stderr lines are kept for connect errors.
const STDERR_TAIL_LINES: usize = 20;
/// Bound on closing one session (child shutdown or HTTP DELETE).
const CLOSE_TIMEOUT: Duration = Duration::from_secs(10);

/// A live session with one server.
pub(crate) struct Connection {
    /// Sends requests; multiplexes concurrent ones by request id.
    pub(crate) peer: Peer<RoleClient>,
    /// Cleared when the transport reports end of input (child exited, HTTP worker ended).
    alive: Arc<AtomicBool>,
    /// Owns the background loop; dropping it ends the session (kills the child, DELETEs the
    /// HTTP session) asynchronously, `close` does it and waits.
    service: tokio::sync::Mutex<Option<RunningService<RoleClient, ClientConfig>>>,
    /// The child's pid (stdio), for logs.
    pub(crate) pid: Option<u32>,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("alive", &self.is_alive())
            .field("pid", &self.pid)
            .finish_non_exhaustive()
    }
}

impl Connection {
    pub(crate) fn is_alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst)
    }

    /// Marks the session dead, so that the pool replaces it.
    pub(crate) fn mark_dead(&self) {
        self.alive.store(false, Ordering::SeqCst);
    }

    /// Ends the session and waits (bounded) until the child is gone / the session deleted.
    pub(crate) async fn close(&self) {
        self.mark_dead();
        let service = self.service.lock().await.take();
        if let Some(mut service) = service {
            match service.close_with_timeout(CLOSE_TIMEOUT).await {
                Ok(Some(reason)) => tracing::debug!(?reason, "MCP session closed"),
                Ok(None) => tracing::warn!("MCP session did not close within {CLOSE_TIMEOUT:?}"),
                Err(error) => tracing::warn!(%error, "MCP session task failed while closing"),
            }
        }
    }
}

/// What the pool announces itself as.
fn client_info() -> ClientConfig {
    ClientConfig::new(
        ClientCapabilities::default(),
        Implementation::new("kedge", env!("CARGO_PKG_VERSION")),
    )
    .with_protocol_version(ProtocolVersion::LATEST_WITH_INITIALIZE)
}

/// Starts a session with `config` (a stdio server's process made by `launcher`) and completes the
/// MCP handshake within `timeout`.
pub(crate) async fn connect(
    server: &str,
    config: &ServerConfig,
    launcher: &dyn Launcher,
    timeout: Duration,
) -> Result<Connection, McpError> {
    let connect_error = |reason: String| McpError::Connect {
        server: server.to_owned(),
        reason,
    };
    let alive = Arc::new(AtomicBool::new(true));
    match config {
        ServerConfig::Stdio {
            command,
            args,
            env,
            sandbox,
        } => {
            // The launcher decides the environment (cleared: the tool service's own is not the
            // server's business), the working directory and any confinement.
            let cmd = launcher
                .command(&Launch {
                    server,
                    command,
                    args,
                    env,
                    sandbox: sandbox.as_ref(),
                })
                .map_err(connect_error)?;
            let mut wrapped = CommandWrap::from(cmd);
            wrapped.wrap(ProcessGroup::leader());
            let (child, stderr) = TokioChildProcess::builder(wrapped)
                .stderr(Stdio::piped())
                .spawn()
                .map_err(|e| connect_error(format!("cannot start {command:?}: {e}")))?;
            let pid = child.id();
            tracing::debug!(?pid, %command, sandboxed = sandbox.is_some(), "started MCP server child");
            let tail = forward_stderr(server, stderr);
            let transport = Watched {
                inner: child,
                alive: alive.clone(),
            };
            match handshake(transport, timeout).await {
                Ok(service) => Ok(Connection::new(service, alive, pid)),
                Err(reason) => {
                    let tail = tail.text().await;
                    Err(connect_error(if tail.is_empty() {
                        reason
                    } else {
                        format!("{reason}; stderr: {tail}")
                    }))
                }
            }
        }
        ServerConfig::Http { url } => {
            let client = http_client().map_err(connect_error)?;
            let transport = StreamableHttpClientTransport::with_client(
                client,
                StreamableHttpClientTransportConfig::with_uri(url.as_str()),
            );
            let transport = Watched {
                inner: transport,
                alive: alive.clone(),
            };
            let service = handshake(transport, timeout).await.map_err(connect_error)?;
            Ok(Connection::new(service, alive, None))
        }
    }
}

impl Connection {
    fn new(
        service: RunningService<RoleClient, ClientConfig>,
        alive: Arc<AtomicBool>,
        pid: Option<u32>,
    ) -> Self {
        if let Some(info) = service.peer().peer_info() {
            tracing::info!(
                protocol = %info.protocol_version,
                server_name = info.server_info.as_ref().map(|i| i.name.as_str()),
                server_version = info.server_info.as_ref().map(|i| i.version.as_str()),
                ?pid,
                "MCP session open"
            );
        }
        Self {
            peer: service.peer().clone(),
            alive,
            service: tokio::sync::Mutex::new(Some(service)),
            pid,
        }
    }
}

/// `initialize` / `notifications/initialized`, bounded by `timeout`. Dropping the transport on
/// failure ends the child.
async fn handshake<T>(
    transport: T,
    timeout: Duration,
) -> Result<RunningService<RoleClient, ClientConfig>, String>
where
    T: Transport<RoleClient> + 'static,
{
    match tokio::time::timeout(timeout, client_info().serve(transport)).await {
        Ok(Ok(service)) => Ok(service),
        Ok(Err(error)) => Err(format!("MCP handshake failed: {error}")),
        Err(_) => Err(format!("no answer to initialize within {timeout:?}")),
    }
}

/// The HTTP client for Streamable HTTP servers: rustls with the ring provider and the platform's
/// trust store; no redirects (a redirected POST can lose its body or leak the session id to
/// another origin); no idle connection reuse (rmcp's advice: avoids delayed-ACK stalls on Linux).
fn http_client() -> Result<reqwest::Client, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS setup: {e}"))?;
    let mut tls = match rustls_platform_verifier::Verifier::new(provider) {
        Ok(verifier) => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(verifier))
            .with_no_client_auth(),
        // Plain http:// servers must still work on a machine without a trust store.
        Err(error) => {
            tracing::warn!(%error, "no TLS trust store: https MCP servers will be refused");
            builder
                .with_root_certificates(rustls::RootCertStore::empty())
                .with_no_client_auth()
        }
    };
    tls.alpn_protocols = vec![b"http/1.1".to_vec()];
    reqwest::Client::builder()
        .tls_backend_preconfigured(tls)
        .connect_timeout(Duration::from_secs(10))
        .pool_max_idle_per_host(0)
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .map_err(|e| format!("cannot build the HTTP client: {e}"))
}

/// The last lines of a child's stderr, and a signal for when the child closed it.
struct StderrTail {
    lines: Arc<Mutex<VecDeque<String>>>,
    closed: Option<tokio::sync::oneshot::Receiver<()>>,
}

impl StderrTail {
    /// The kept lines, joined; waits a little for the child to finish writing (it usually just
    /// exited, which is why the handshake failed).
    async fn text(mut self) -> String {
        if let Some(closed) = self.closed.take() {
            let _ = tokio::time::timeout(Duration::from_millis(500), closed).await;
        }
        self.lines
            .lock()
            .map(|lines| {
                lines
                    .iter()
                    .map(String::as_str)
                    .collect::<Vec<_>>()
                    .join(" | ")
            })
            .unwrap_or_default()
    }
}

/// Forwards the child's stderr to tracing, line by line, keeping the last few lines.
fn forward_stderr(server: &str, stderr: Option<ChildStderr>) -> StderrTail {
    let lines: Arc<Mutex<VecDeque<String>>> = Arc::default();
    let Some(stderr) = stderr else {
        return StderrTail {
            lines,
            closed: None,
        };
    };
    let (closed_tx, closed) = tokio::sync::oneshot::channel();
    let server = server.to_owned();
    let keep = lines.clone();
    tokio::spawn(async move {
        let mut reader = BufReader::new(stderr).lines();
        while let Ok(Some(line)) = reader.next_line().await {
            tracing::debug!(target: "kedge_mcp::stderr", server = %server, "{line}");
            if let Ok(mut tail) = keep.lock() {
                if tail.len() == STDERR_TAIL_LINES {
                    tail.pop_front();
                }
                tail.push_back(line);
            }
        }
        let _ = closed_tx.send(());
    });
    StderrTail {
        lines,
        closed: Some(closed),
    }
}

/// A transport that records when it reaches end of input, so the pool can tell a dead session
/// from a live one before sending on it.
struct Watched<T> {
    inner: T,
    alive: Arc<AtomicBool>,
}

impl<T: Transport<RoleClient>> Transport<RoleClient> for Watched<T> {
    type Error = T::Error;

    fn send(
        &mut self,
        item: TxJsonRpcMessage<RoleClient>,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send + 'static {
        let alive = self.alive.clone();
        let sent = self.inner.send(item);
        async move {
            let result = sent.await;
            if result.is_err() {
                // A pipe to a child breaks only when the child is gone; for HTTP a failed POST
                // also means the session is in doubt. Either way: reconnect next time.
                alive.store(false, Ordering::SeqCst);
            }
            result
        }
    }

    fn receive(&mut self) -> impl Future<Output = Option<RxJsonRpcMessage<RoleClient>>> + Send {
        let alive = self.alive.clone();
        let received = self.inner.receive();
        async move {
            let message = received.await;
            if message.is_none() {
                alive.store(false, Ordering::SeqCst);
            }
            message
        }
    }

    fn close(&mut self) -> impl Future<Output = Result<(), Self::Error>> + Send {
        self.alive.store(false, Ordering::SeqCst);
        self.inner.close()
    }
}
