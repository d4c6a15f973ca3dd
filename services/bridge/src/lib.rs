//! The bridge: Kedge's HTTP API and SSE.
//!
//! Browsers and services reach Kedge here: submit a task, list and inspect runs, read a run's
//! history, watch it live over SSE (resumable from any bridge), send a message, answer a
//! question, decide an approval, resolve an ambiguous operation, request cancellation.
//! docs/API.md is the reference; `schemas/openapi.json` the contract (a test checks it against
//! [`ROUTES`]). The web console ([`console`]) is served at `/` from assets compiled into the
//! binary, on the API's origin; its event streams authenticate with SSE tickets ([`ticket`]).
//!
//! Invariants:
//! - **Stateless.** Every answer comes from the broker: the journal for anything about one run,
//!   the `kedge_runs` projection for lists (read through [`kedge_runtime::projection`]; the
//!   projector service, `kedge_projector`, writes it). A bridge keeps only caches of facts
//!   that never change (a run's tenant) and the live fan-out of runs being watched ([`sse`]), so
//!   any number can run, and any can be restarted mid-stream: a client reconnects to any bridge
//!   with `Last-Event-ID` and misses nothing.
//! - **Only inputs.** The bridge appends inputs (`user.message`, `question.answered`,
//!   `cancel.requested`) with deterministic `Nats-Msg-Id`s and publishes tasks to intake; it never
//!   writes a decision.
//! - **Tenant isolation** ([`auth`]): a caller sees and acts on only its tenant's runs; another
//!   tenant's run is a 404.
//! - **Bad input never crashes it** ([`problem`]): every failure is a problem-details answer that
//!   names the field at fault.

pub mod api;
pub mod auth;
pub mod console;
pub mod problem;
pub mod quota;
pub mod sse;
pub mod tenants;
pub mod ticket;
pub use kedge_app::view;

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{DefaultBodyLimit, FromRequestParts};
use axum::http::Method;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, delete, get, post, put};
use axum::{Json, Router};
use kedge_runtime::Runtime;
use kedge_runtime::config::BridgeConfig;
use kedge_runtime::projection::Projection;
use tokio::net::TcpListener;
use tokio::sync::{Mutex, Semaphore, watch};

pub use auth::{Auth, Caller, Scope};
pub use problem::Problem;

/// The OpenAPI document (`schemas/openapi.json`), served at `/openapi.json`.
pub const OPENAPI: &str = include_str!("../../../schemas/openapi.json");

/// Every route the bridge serves: (method, path in OpenAPI syntax). The router is built from
/// this table, and a test checks it against `schemas/openapi.json` both ways.
pub const ROUTES: &[(&str, &str)] = &[
    ("POST", "/v1/runs"),
    ("GET", "/v1/runs"),
    ("GET", "/v1/runs/{id}"),
    ("GET", "/v1/runs/{id}/history"),
    ("GET", "/v1/runs/{id}/events"),
    ("GET", "/v1/runs/{id}/blobs/{digest}"),
    ("POST", "/v1/runs/{id}/messages"),
    ("POST", "/v1/runs/{id}/answers/{question_id}"),
    ("POST", "/v1/runs/{id}/cancel"),
    ("POST", "/v1/runs/{id}/approvals/{approval_id}"),
    ("POST", "/v1/runs/{id}/operations/{op}/resolve"),
    ("POST", "/v1/runs/{id}/sse-ticket"),
    ("POST", "/v1/callbacks/{key}"),
    ("GET", "/v1/whoami"),
    ("GET", "/v1/schedules"),
    ("GET", "/v1/schedules/{name}"),
    ("PUT", "/v1/schedules/{name}"),
    ("DELETE", "/v1/schedules/{name}"),
    ("POST", "/v1/schedules/{name}/pause"),
    ("POST", "/v1/schedules/{name}/resume"),
    ("POST", "/v1/schedules/{name}/trigger"),
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/openapi.json"),
];

/// How often `/readyz` re-runs the broker layout check (between checks it trusts the last one).
const LAYOUT_CHECK_EVERY: Duration = Duration::from_secs(10);

/// Why the bridge cannot start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum BridgeError {
    #[error(transparent)]
    Auth(#[from] auth::AuthConfigError),
    #[error(transparent)]
    Runtime(#[from] kedge_runtime::RuntimeError),
    #[error("cannot listen on {addr}: {reason}")]
    Bind { addr: String, reason: String },
    #[error("the HTTP server failed: {0}")]
    Serve(String),
}

/// The shared state of a bridge process. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Bridge {
    inner: Arc<Inner>,
}

#[derive(Debug)]
pub struct Inner {
    pub rt: Runtime,
    pub config: BridgeConfig,
    pub auth: Auth,
    pub hub: Arc<sse::Hub>,
    pub projection: Projection,
    pub tenants: tenants::TenantCache,
    pub sse_slots: Arc<Semaphore>,
    /// Per-tenant limits: SSE connections and run starts ([`quota`]).
    pub quotas: Arc<quota::Quotas>,
    pub shutdown: watch::Receiver<bool>,
    shutdown_tx: watch::Sender<bool>,
    last_layout_check: Mutex<Option<Instant>>,
}

impl std::ops::Deref for Bridge {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.inner
    }
}

impl Bridge {
    /// Checks the auth configuration (warning loudly in open mode) and opens the stores.
    pub async fn new(rt: Runtime) -> Result<Bridge, BridgeError> {
        let config = rt.config.bridge.clone();
        let auth = Auth::from_config(&config)?;
        if auth.is_open() {
            tracing::warn!(
                tenant = %config.open_tenant,
                "the bridge runs in OPEN DEVELOPMENT MODE: requests without a token act for \
                 tenant `{}`; do not expose it",
                config.open_tenant
            );
        }
        let projection = Projection::open(&rt).await?;
        let (shutdown_tx, shutdown) = watch::channel(false);
        Ok(Bridge {
            inner: Arc::new(Inner {
                hub: sse::Hub::new(rt.journal.clone(), rt.client.clone(), config.sse_ring),
                tenants: tenants::TenantCache::new(&rt),
                sse_slots: Arc::new(Semaphore::new(config.max_sse_connections)),
                quotas: quota::Quotas::new(config.max_sse_per_tenant, config.runs_per_minute),
                projection,
                auth,
                config,
                rt,
                shutdown,
                shutdown_tx,
                last_layout_check: Mutex::new(Some(Instant::now())),
            }),
        })
    }

    /// Ends every SSE stream (so a graceful shutdown does not wait on them).
    pub fn close_streams(&self) {
        let _ = self.shutdown_tx.send(true);
    }

    /// Ready: connected, and the layout check passed within `LAYOUT_CHECK_EVERY`.
    pub async fn ready(&self) -> Result<(), String> {
        use async_nats::connection::State;
        if self.rt.client.connection_state() != State::Connected {
            return Err("not connected to NATS".into());
        }
        let mut last = self.last_layout_check.lock().await;
        if last.is_some_and(|t| t.elapsed() < LAYOUT_CHECK_EVERY) {
            return Ok(());
        }
        let options = kedge_journal::LayoutOptions {
            replicas: self.rt.config.replicas,
        };
        let check = kedge_journal::ensure_layout(&self.rt.client, &options);
        match tokio::time::timeout(Duration::from_secs(5), check).await {
            Ok(Ok(_)) => {
                *last = Some(Instant::now());
                Ok(())
            }
            Ok(Err(e)) => {
                *last = None;
                Err(format!("broker layout check failed: {e}"))
            }
            Err(_) => {
                *last = None;
                Err("broker layout check timed out".into())
            }
        }
    }
}

impl FromRequestParts<Bridge> for Caller {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, bridge: &Bridge) -> Result<Caller, Problem> {
        // A browser's EventSource on a run's stream: the SSE ticket cookie, when the request
        // carries no token of its own ([`ticket`]).
        if parts.method == Method::GET
            && !parts
                .headers
                .contains_key(axum::http::header::AUTHORIZATION)
            && auth::query_token(parts.uri.query()).is_none()
            && let Some(run) = events_run(parts.uri.path())
        {
            let tickets = ticket::cookies(&parts.headers);
            let now = ticket::now_unix();
            let mut refused = None;
            for t in &tickets {
                match bridge.auth.ticket_caller(t, &run, now) {
                    Ok(caller) => return Ok(caller),
                    Err(p) => refused = Some(p),
                }
            }
            if let Some(p) = refused {
                return Err(p);
            }
        }
        bridge
            .auth
            .authenticate(&parts.method, &parts.headers, parts.uri.query())
    }
}

/// The run of a `/v1/runs/{id}/events` path.
fn events_run(path: &str) -> Option<kedge_core::ids::RunId> {
    path.strip_prefix("/v1/runs/")?
        .strip_suffix("/events")?
        .parse()
        .ok()
}

fn handler_for(method: &str, path: &str) -> Option<MethodRouter<Bridge>> {
    Some(match (method, path) {
        ("POST", "/v1/runs") => post(api::submit),
        ("GET", "/v1/runs") => get(api::list),
        ("GET", "/v1/runs/{id}") => get(api::get_run),
        ("GET", "/v1/runs/{id}/history") => get(api::history),
        ("GET", "/v1/runs/{id}/events") => get(api::events),
        ("GET", "/v1/runs/{id}/blobs/{digest}") => get(api::blob),
        ("POST", "/v1/runs/{id}/messages") => post(api::message),
        ("POST", "/v1/runs/{id}/answers/{question_id}") => post(api::answer),
        ("POST", "/v1/runs/{id}/cancel") => post(api::cancel),
        ("POST", "/v1/runs/{id}/approvals/{approval_id}") => post(api::approve),
        ("POST", "/v1/runs/{id}/operations/{op}/resolve") => post(api::resolve),
        ("POST", "/v1/runs/{id}/sse-ticket") => post(api::sse_ticket),
        ("POST", "/v1/callbacks/{key}") => post(api::callback),
        ("GET", "/v1/whoami") => get(api::whoami),
        ("GET", "/v1/schedules") => get(api::schedules::list),
        ("GET", "/v1/schedules/{name}") => get(api::schedules::get),
        ("PUT", "/v1/schedules/{name}") => put(api::schedules::put),
        ("DELETE", "/v1/schedules/{name}") => delete(api::schedules::delete),
        ("POST", "/v1/schedules/{name}/pause") => post(api::schedules::pause),
        ("POST", "/v1/schedules/{name}/resume") => post(api::schedules::resume),
        ("POST", "/v1/schedules/{name}/trigger") => post(api::schedules::trigger),
        ("GET", "/healthz") => get(api::healthz),
        ("GET", "/readyz") => get(api::readyz),
        ("GET", "/openapi.json") => get(openapi),
        _ => return None,
    })
}

async fn openapi() -> Response {
    match serde_json::from_str::<serde_json::Value>(OPENAPI) {
        Ok(v) => Json(v).into_response(),
        Err(e) => Problem::internal(e.to_string()).into_response(),
    }
}

/// The bridge's router, built from [`ROUTES`].
pub fn router(bridge: Bridge) -> Router {
    let limit = bridge.config.max_body_bytes;
    let mut router: Router<Bridge> = Router::new();
    for (method, path) in ROUTES {
        match handler_for(method, path) {
            Some(h) => router = router.route(path, h),
            None => tracing::error!(method, path, "route without a handler"),
        }
    }
    router = router.merge(console::router());
    let timeout = Duration::from_millis(bridge.config.request_timeout_ms);
    router
        .fallback(api::not_found)
        .method_not_allowed_fallback(api::method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        .layer(axum::middleware::from_fn(move |req, next| {
            request_timeout(timeout, req, next)
        }))
        .with_state(bridge)
}

/// Every request but an event stream gets `timeout` to be answered; past it, 503.
async fn request_timeout(
    timeout: Duration,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if req.uri().path().ends_with("/events") {
        return next.run(req).await;
    }
    match tokio::time::timeout(timeout, next.run(req)).await {
        Ok(response) => response,
        Err(_) => Problem::unavailable(
            format!("the request was not answered within {timeout:?}"),
            1,
        )
        .into_response(),
    }
}

/// Whether [`ROUTES`] has a handler for every entry (checked by a test).
pub fn routes_have_handlers() -> bool {
    ROUTES.iter().all(|(m, p)| handler_for(m, p).is_some())
        && ROUTES.iter().all(|(m, _)| m.parse::<Method>().is_ok())
}

/// Runs the bridge on `bridge.listen` until `shutdown` resolves.
pub async fn run(
    rt: Runtime,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), BridgeError> {
    let addr = rt.config.bridge.listen.clone();
    let bridge = Bridge::new(rt).await?;
    let listener = TcpListener::bind(&addr)
        .await
        .map_err(|e| BridgeError::Bind {
            addr: addr.clone(),
            reason: e.to_string(),
        })?;
    serve(bridge, listener, shutdown).await
}

/// How long a client has to send a request's line and headers, from the moment the bridge starts
/// reading them (on a new connection, and on a kept-alive one between requests). A connection
/// that trickles its headers or stops half-way (slowloris) is closed at this point, so it cannot
/// hold a connection slot forever. Fixed (the bridge's configuration has no field for it yet);
/// [`serve_with_header_timeout`] takes another value.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// How long in-flight requests may take to finish once shutdown begins.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves `bridge` on `listener` until `shutdown` resolves; then ends the SSE streams, lets
/// in-flight requests finish (up to 10 s) and returns. HTTP/1.1, with [`HEADER_READ_TIMEOUT`].
pub async fn serve(
    bridge: Bridge,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), BridgeError> {
    serve_with_header_timeout(bridge, listener, shutdown, HEADER_READ_TIMEOUT).await
}

/// [`serve`] with a header-read timeout of `header_timeout` (a test's short one).
///
/// Each accepted connection is served by hyper's HTTP/1 connection with a timer, so the
/// header-read timeout applies (`axum::serve` sets no timer, and so has none); the request
/// timeout is the router's ([`router`]).
pub async fn serve_with_header_timeout(
    bridge: Bridge,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
    header_timeout: Duration,
) -> Result<(), BridgeError> {
    use hyper_util::rt::{TokioIo, TokioTimer};
    use hyper_util::service::TowerToHyperService;

    let local = listener
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_default();
    tracing::info!(listen = %local, header_timeout_ms = header_timeout.as_millis() as u64, "bridge serving");
    let (stop_tx, stop_rx) = watch::channel(false);
    let closer = bridge.clone();
    tokio::spawn(async move {
        shutdown.await;
        closer.close_streams();
        let _ = stop_tx.send(true);
    });
    let app = router(bridge);
    // Every connection's task holds a receiver; the sender sees them all gone once they end.
    let (open_tx, open_rx) = watch::channel(());
    let mut stopping = stop_rx.clone();
    loop {
        let stop = async {
            let _ = stopping.wait_for(|s| *s).await;
        };
        let (stream, _) = tokio::select! {
            _ = stop => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of descriptors, a connection reset before it was accepted: the
                    // listener itself is fine.
                    tracing::warn!(error = %e, "bridge: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        let mut graceful = stop_rx.clone();
        let open = open_rx.clone();
        tokio::spawn(async move {
            let stop = async move {
                let _ = graceful.wait_for(|s| *s).await;
            };
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout);
            let conn = builder.serve_connection(TokioIo::new(stream), service);
            tokio::pin!(conn);
            let served = tokio::select! {
                r = conn.as_mut() => r,
                _ = stop => {
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            };
            if let Err(e) = served {
                tracing::debug!(error = %e, "bridge: connection ended with an error");
            }
            drop(open);
        });
    }
    drop(open_rx);
    drop(listener);
    tokio::select! {
        _ = open_tx.closed() => {}
        _ = tokio::time::sleep(DRAIN_TIMEOUT) => {
            tracing::warn!("bridge: connections still open 10 s after shutdown; closing them");
        }
    }
    tracing::info!("bridge stopped");
    Ok(())
}
