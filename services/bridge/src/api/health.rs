//! Who the caller is, the health checks, and the fallbacks for unknown paths and methods.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::Bridge;
use crate::auth::Caller;
use crate::problem::Problem;

/// `GET /v1/whoami`: the tenant and scope of the caller's token (the console shows only the
/// actions the scope allows).
pub(crate) async fn whoami(caller: Caller) -> Response {
    Json(json!({
        "tenant": caller.tenant,
        "scope": caller.scope.as_str(),
        "caller": caller.name,
        "can_write": caller.scope.can_write(),
        "can_approve": caller.scope.can_approve(),
    }))
    .into_response()
}

/// `GET /healthz`: the process is up.
pub(crate) async fn healthz() -> Response {
    Json(json!({ "status": "ok" })).into_response()
}

/// `GET /readyz`: connected to the broker, and the broker passed the layout check recently.
pub(crate) async fn readyz(State(bridge): State<Bridge>) -> Response {
    match bridge.ready().await {
        Ok(()) => Json(json!({ "status": "ready" })).into_response(),
        Err(why) => Problem::unavailable(why, 1).into_response(),
    }
}

/// Any other path.
pub(crate) async fn not_found() -> Problem {
    Problem::not_found("no such endpoint; see /openapi.json")
}

/// A known path with another method.
pub(crate) async fn method_not_allowed() -> Problem {
    Problem::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method-not-allowed",
        "Method not allowed",
        "this endpoint does not take that method; see /openapi.json",
    )
}
