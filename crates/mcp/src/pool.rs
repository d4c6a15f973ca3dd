//! The pool: one lazily opened session per configured server, shared by all callers.

use std::collections::BTreeMap;
use std::fmt;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use rmcp::ServiceError;
use rmcp::model::{
    CallToolRequest, CallToolRequestParams, CallToolResult, ClientRequest, RequestMetaObject,
    ServerResult,
};
use rmcp::service::{PeerRequestOptions, RequestHandle, RoleClient};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use tokio::time::Instant;
use tracing::Instrument as _;

use crate::connection::{self, Connection};
use crate::{Direct, Launcher, McpError, ServerConfig, content};

/// The `_meta` key that carries the caller's operation id on every `tools/call`.
pub const OPERATION_ID_META_KEY: &str = "kedge/operation_id";

/// The `_meta` key that carries the call's deadline (an RFC 3339 time): when the caller stops
/// waiting for it. A server that has not started the operation by then should not start it:
/// a runner that took the operation over re-runs it only once the deadline (and a grace) has
/// passed without a result (docs/API.md "Status queries for MCP tools").
pub const DEADLINE_META_KEY: &str = "kedge/deadline";

/// Default bound on starting a server and its `initialize` handshake, and on `tools/list`.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// Bound on sending a `notifications/cancelled` when a call is stopped or times out.
const CANCEL_SEND_TIMEOUT: Duration = Duration::from_secs(2);

/// One tool a server offers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolInfo {
    /// The name to call it by.
    pub name: String,
    /// What it does, for the model.
    pub description: Option<String>,
    /// JSON Schema of its arguments (an object schema).
    pub input_schema: Value,
    /// The tool's `_meta` as the server lists it (e.g. `"kedge/sees_in_flight"` on a status
    /// tool, docs/API.md "Status queries for MCP tools"); `None` when it has none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub meta: Option<Map<String, Value>>,
}

/// How a call ended, when the pool could tell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The server answered. `is_error` is the tool's own failure (`isError: true`), or a JSON-RPC
    /// error answer such as "unknown tool" (then `content` is `"MCP error <code>: <message>"`):
    /// both are for the model to read, not errors of the pool.
    Completed {
        /// The answer as text: see the crate docs for how content blocks are rendered.
        content: String,
        /// Whether the tool reported a failure.
        is_error: bool,
    },
    /// `stop` resolved first; the server was sent `notifications/cancelled`. The tool may have
    /// done part or all of its work.
    Stopped,
    /// The call's timeout elapsed first; the server was sent `notifications/cancelled`. The tool
    /// may have done part or all of its work.
    TimedOut,
}

/// Connections to the configured MCP servers; see the crate docs. Cheap to clone.
#[derive(Clone)]
pub struct Pool {
    inner: Arc<Inner>,
}

struct Inner {
    servers: BTreeMap<String, Server>,
    connect_timeout: Duration,
    /// Makes the processes of stdio servers.
    launcher: Arc<dyn Launcher>,
}

struct Server {
    config: ServerConfig,
    /// The current session. Held across connecting, so concurrent first callers wait for one
    /// session instead of each starting a child.
    current: tokio::sync::Mutex<Option<Arc<Connection>>>,
}

impl fmt::Debug for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut map = f.debug_map();
        for (name, server) in &self.inner.servers {
            let state = match server.current.try_lock() {
                Ok(current) => match current.as_ref() {
                    Some(conn) if conn.is_alive() => "connected",
                    Some(_) => "dead",
                    None => "idle",
                },
                Err(_) => "busy",
            };
            map.entry(name, &format_args!("{:?} ({state})", server.config));
        }
        map.finish()
    }
}

impl Pool {
    /// A pool over `servers` (name → how to reach it). Nothing is started until first use.
    ///
    /// Stdio servers are started unconfined ([`Direct`]); one whose configuration asks for a
    /// sandbox is refused (a [`McpError::Connect`] naming it): use [`Pool::with_launcher`] with a
    /// sandboxing launcher for those.
    pub fn new(servers: BTreeMap<String, ServerConfig>) -> Self {
        Self::build(servers, DEFAULT_CONNECT_TIMEOUT, Arc::new(Direct))
    }

    /// Like [`Pool::new`], with a bound on starting a server plus its handshake (and on
    /// `tools/list`) other than [`DEFAULT_CONNECT_TIMEOUT`].
    pub fn with_connect_timeout(
        servers: BTreeMap<String, ServerConfig>,
        connect_timeout: Duration,
    ) -> Self {
        Self::build(servers, connect_timeout, Arc::new(Direct))
    }

    /// Like [`Pool::new`], with the processes of stdio servers made by `launcher` (e.g. one that
    /// confines them in a sandbox).
    pub fn with_launcher(
        servers: BTreeMap<String, ServerConfig>,
        launcher: Arc<dyn Launcher>,
    ) -> Self {
        Self::build(servers, DEFAULT_CONNECT_TIMEOUT, launcher)
    }

    /// [`Pool::with_launcher`] with a connect timeout of its own.
    pub fn with_launcher_and_connect_timeout(
        servers: BTreeMap<String, ServerConfig>,
        launcher: Arc<dyn Launcher>,
        connect_timeout: Duration,
    ) -> Self {
        Self::build(servers, connect_timeout, launcher)
    }

    fn build(
        servers: BTreeMap<String, ServerConfig>,
        connect_timeout: Duration,
        launcher: Arc<dyn Launcher>,
    ) -> Self {
        let servers = servers
            .into_iter()
            .map(|(name, config)| {
                let server = Server {
                    config,
                    current: tokio::sync::Mutex::new(None),
                };
                (name, server)
            })
            .collect();
        Self {
            inner: Arc::new(Inner {
                servers,
                connect_timeout,
                launcher,
            }),
        }
    }

    /// Whether a server of that name is configured.
    pub fn has_server(&self, name: &str) -> bool {
        self.inner.servers.contains_key(name)
    }

    /// The configured server names, sorted.
    pub fn server_names(&self) -> impl Iterator<Item = &str> {
        self.inner.servers.keys().map(String::as_str)
    }

    /// The tools `server` offers (all pages of `tools/list`). Connects if needed; retried once
    /// on a fresh connection if the session turns out to be dead (listing has no side effects).
    pub async fn tools(&self, server: &str) -> Result<Vec<ToolInfo>, McpError> {
        let span = tracing::info_span!("mcp_tools", server);
        async {
            let timeout = self.inner.connect_timeout;
            let mut retried = false;
            loop {
                let conn = self.connection(server).await?;
                let listed = tokio::time::timeout(timeout, conn.peer.list_all_tools()).await;
                let error = match listed {
                    Ok(Ok(tools)) => {
                        return Ok(tools
                            .into_iter()
                            .map(|tool| ToolInfo {
                                name: tool.name.into_owned(),
                                description: tool.description.map(|d| d.into_owned()),
                                input_schema: Value::Object((*tool.input_schema).clone()),
                                meta: tool.meta.map(|m| m.0),
                            })
                            .collect());
                    }
                    Ok(Err(error)) => error,
                    Err(_) => {
                        return Err(McpError::TimedOut {
                            server: server.to_owned(),
                            after: timeout,
                        });
                    }
                };
                if let ServiceError::McpError(error) = &error {
                    return Err(McpError::Protocol {
                        server: server.to_owned(),
                        reason: format!(
                            "tools/list failed: MCP error {}: {}",
                            error.code.0, error.message
                        ),
                    });
                }
                if is_transport_failure(&error) {
                    self.evict(server, &conn);
                    if !retried {
                        retried = true;
                        tracing::debug!(%error, "session dead during tools/list; reconnecting");
                        continue;
                    }
                    return Err(McpError::Disconnected {
                        server: server.to_owned(),
                        reason: error.to_string(),
                    });
                }
                return Err(McpError::Protocol {
                    server: server.to_owned(),
                    reason: format!("tools/list failed: {error}"),
                });
            }
        }
        .instrument(span)
        .await
    }

    /// Calls one tool and waits for its answer, for `stop`, or for `timeout`, whichever first.
    ///
    /// - `operation_id` goes to the server in the request's `_meta` as
    ///   [`"kedge/operation_id"`](OPERATION_ID_META_KEY), so a server can deduplicate retries.
    /// - `stop` resolving first: the server is sent `notifications/cancelled` for this request
    ///   (with a reason) and the result is [`Outcome::Stopped`].
    /// - `timeout` (counted from this call, connecting included) elapsing first: the same, with
    ///   [`Outcome::TimedOut`].
    /// - Dropping the returned future while the request is in flight also sends the cancel.
    ///
    /// A JSON-RPC error answer (e.g. `-32602` for an unknown tool, as Python servers answer) is
    /// `Completed { is_error: true, content: "MCP error <code>: <message>" }`. See [`McpError`]
    /// for what an `Err` means for side effects: [`McpError::Disconnected`] is ambiguous.
    pub async fn call(
        &self,
        server: &str,
        tool: &str,
        arguments: Map<String, Value>,
        operation_id: &str,
        timeout: Duration,
        stop: impl Future<Output = ()>,
    ) -> Result<Outcome, McpError> {
        let span = tracing::info_span!(
            "mcp_call",
            server,
            tool,
            operation_id,
            request_id = tracing::field::Empty,
            pid = tracing::field::Empty,
        );
        self.call_inner(server, tool, arguments, operation_id, timeout, stop)
            .instrument(span)
            .await
    }

    async fn call_inner(
        &self,
        server: &str,
        tool: &str,
        arguments: Map<String, Value>,
        operation_id: &str,
        timeout: Duration,
        stop: impl Future<Output = ()>,
    ) -> Result<Outcome, McpError> {
        let deadline = Instant::now() + timeout;
        let mut stop = pin!(stop);
        let mut retried = false;
        loop {
            // Connecting counts against the caller's patience too; nothing is sent yet, so giving
            // up here needs no cancel.
            let conn = tokio::select! {
                biased;
                conn = self.connection(server) => conn?,
                () = &mut stop => return Ok(Outcome::Stopped),
                () = tokio::time::sleep_until(deadline) => return Ok(Outcome::TimedOut),
            };
            if let Some(pid) = conn.pid {
                tracing::Span::current().record("pid", pid);
            }

            let mut meta = Map::new();
            meta.insert(OPERATION_ID_META_KEY.to_owned(), Value::from(operation_id));
            let left = deadline.saturating_duration_since(Instant::now());
            if let Ok(at) = (time::OffsetDateTime::now_utc() + left)
                .format(&time::format_description::well_known::Rfc3339)
            {
                meta.insert(DEADLINE_META_KEY.to_owned(), Value::from(at));
            }
            let mut params =
                CallToolRequestParams::new(tool.to_owned()).with_arguments(arguments.clone());
            params.meta = Some(RequestMetaObject::from(meta));
            let request = ClientRequest::CallToolRequest(CallToolRequest::new(params));

            let handle = match conn
                .peer
                .send_cancellable_request(request, PeerRequestOptions::no_options())
                .await
            {
                Ok(handle) => handle,
                // The session's loop had already ended: the request was never written. Safe to
                // retry once on a fresh session.
                Err(ServiceError::TransportClosed) if !retried => {
                    retried = true;
                    self.evict(server, &conn);
                    tracing::debug!("session was dead before sending; reconnecting");
                    continue;
                }
                Err(error) => {
                    self.evict(server, &conn);
                    return Err(McpError::Connect {
                        server: server.to_owned(),
                        reason: format!("cannot send the request: {error}"),
                    });
                }
            };
            tracing::Span::current().record("request_id", tracing::field::display(&handle.id));
            let mut in_flight = InFlight {
                handle: Some(handle),
            };

            let answer = tokio::select! {
                // An answer that is already here wins over a stop that is also ready: it is the
                // truth about what the tool did.
                biased;
                answer = in_flight.answer() => answer,
                () = &mut stop => {
                    in_flight.cancel("stopped by the caller").await;
                    tracing::info!("call stopped; cancel sent");
                    return Ok(Outcome::Stopped);
                }
                () = tokio::time::sleep_until(deadline) => {
                    in_flight.cancel(&format!("timed out after {timeout:?}")).await;
                    tracing::info!(?timeout, "call timed out; cancel sent");
                    return Ok(Outcome::TimedOut);
                }
            };
            in_flight.disarm();

            return match answer {
                Ok(Ok(result)) => completed(server, result),
                Ok(Err(ServiceError::McpError(error))) => Ok(Outcome::Completed {
                    content: format!("MCP error {}: {}", error.code.0, error.message),
                    is_error: true,
                }),
                Ok(Err(error)) if is_transport_failure(&error) => {
                    self.evict(server, &conn);
                    Err(McpError::Disconnected {
                        server: server.to_owned(),
                        reason: error.to_string(),
                    })
                }
                Ok(Err(error)) => Err(McpError::Protocol {
                    server: server.to_owned(),
                    reason: error.to_string(),
                }),
                // The session loop dropped the request: it ended with the request in flight.
                Err(_) => {
                    self.evict(server, &conn);
                    Err(McpError::Disconnected {
                        server: server.to_owned(),
                        reason: "the session ended with the request in flight".to_owned(),
                    })
                }
            };
        }
    }

    /// Ends every open session: children are shut down (stdin closed, then SIGTERM, then SIGKILL
    /// to their process group), HTTP sessions are deleted. Calls made afterwards open new ones.
    pub async fn close(&self) {
        let closing = self.inner.servers.iter().map(|(name, server)| async move {
            let conn = server.current.lock().await.take();
            if let Some(conn) = conn {
                conn.close()
                    .instrument(tracing::info_span!("mcp_close", server = %name))
                    .await;
            }
        });
        futures::future::join_all(closing).await;
    }

    /// The live session with `server`, opening one if there is none or the last one died.
    async fn connection(&self, server: &str) -> Result<Arc<Connection>, McpError> {
        let entry = self
            .inner
            .servers
            .get(server)
            .ok_or_else(|| McpError::UnknownServer(server.to_owned()))?;
        let mut current = entry.current.lock().await;
        if let Some(conn) = current.as_ref() {
            if conn.is_alive() {
                return Ok(conn.clone());
            }
            tracing::info!(server, "MCP session died; reconnecting");
        }
        // Dropping the dead session ends its loop and child in the background.
        *current = None;
        let conn = Arc::new(
            connection::connect(
                server,
                &entry.config,
                self.inner.launcher.as_ref(),
                self.inner.connect_timeout,
            )
            .await?,
        );
        *current = Some(conn.clone());
        Ok(conn)
    }

    /// Marks `conn` dead and drops it from the pool if it is still the current session of
    /// `server`. Never waits: if someone holds the slot (connecting), they will see it is dead.
    fn evict(&self, server: &str, conn: &Arc<Connection>) {
        conn.mark_dead();
        if let Some(entry) = self.inner.servers.get(server)
            && let Ok(mut current) = entry.current.try_lock()
            && current.as_ref().is_some_and(|c| Arc::ptr_eq(c, conn))
        {
            *current = None;
        }
    }
}

/// Errors that mean the session is gone (as opposed to an answer the server gave).
fn is_transport_failure(error: &ServiceError) -> bool {
    matches!(
        error,
        ServiceError::TransportClosed | ServiceError::TransportSend(_)
    )
}

/// The server's result as an outcome; anything that is not a tool result breaks the protocol.
fn completed(server: &str, result: ServerResult) -> Result<Outcome, McpError> {
    let result = match result {
        ServerResult::CallToolResult(result) => result,
        ServerResult::EmptyResult(_) => CallToolResult::success(Vec::new()),
        other => {
            // The result union is untagged: a tool result with unusual fields may have been read
            // as another member. Try the JSON again as a tool result before giving up.
            let json = serde_json::to_value(&other).unwrap_or(Value::Null);
            match serde_json::from_value::<CallToolResult>(json.clone()) {
                Ok(result) => result,
                Err(_) => {
                    return Err(McpError::Protocol {
                        server: server.to_owned(),
                        reason: format!(
                            "tools/call answered with something that is not a tool result: {json}"
                        ),
                    });
                }
            }
        }
    };
    let content = serde_json::to_value(&result.content).unwrap_or(Value::Null);
    Ok(Outcome::Completed {
        content: content::render(&content, result.structured_content.as_ref()),
        is_error: result.is_error.unwrap_or(false),
    })
}

/// A request whose answer is awaited. Dropped while armed (the caller's future was dropped), it
/// still tells the server the request is abandoned.
struct InFlight {
    handle: Option<RequestHandle<RoleClient>>,
}

impl InFlight {
    async fn answer(
        &mut self,
    ) -> Result<Result<ServerResult, ServiceError>, tokio::sync::oneshot::error::RecvError> {
        match self.handle.as_mut() {
            Some(handle) => (&mut handle.rx).await,
            None => std::future::pending().await,
        }
    }

    fn disarm(&mut self) {
        self.handle = None;
    }

    /// Sends `notifications/cancelled` for the request (bounded wait for the write).
    async fn cancel(&mut self, reason: &str) {
        let Some(handle) = self.handle.take() else {
            return;
        };
        let id = handle.id.clone();
        match tokio::time::timeout(CANCEL_SEND_TIMEOUT, handle.cancel(Some(reason.to_owned())))
            .await
        {
            Ok(Ok(())) => tracing::debug!(request_id = %id, reason, "sent notifications/cancelled"),
            Ok(Err(error)) => {
                tracing::warn!(request_id = %id, %error, "could not send notifications/cancelled")
            }
            Err(_) => tracing::warn!(request_id = %id, "sending notifications/cancelled timed out"),
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let Some(handle) = self.handle.take() else {
            return;
        };
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _ = tokio::time::timeout(
                    CANCEL_SEND_TIMEOUT,
                    handle.cancel(Some("abandoned by the caller".to_owned())),
                )
                .await;
            });
        }
    }
}
