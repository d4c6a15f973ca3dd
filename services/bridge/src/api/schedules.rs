//! The caller's tenant's schedules (docs/API.md, "Schedules"): `GET /v1/schedules`,
//! `GET|PUT|DELETE /v1/schedules/{name}`, `POST /v1/schedules/{name}/{pause,resume,trigger}`.
//! The work is `kedge_app::schedules`, the same the tenant gateway and the CLI call.

use axum::Json;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use kedge_app::schedules::{self, Op};
use kedge_runtime::schedules::ScheduleError;

use crate::Bridge;
use crate::auth::Caller;
use crate::problem::Problem;

use super::{Result, body};

fn problem(e: ScheduleError) -> Problem {
    match e {
        ScheduleError::Invalid(r) if r.field == "body" => Problem::malformed("body", r.reason),
        ScheduleError::Invalid(r) => Problem::invalid(r.field, r.reason),
        ScheduleError::NotFound(_) => Problem::not_found(e.to_string()),
        ScheduleError::TooMany { .. } => Problem::new(
            StatusCode::TOO_MANY_REQUESTS,
            "too-many-schedules",
            "Too many schedules",
            e.to_string(),
        ),
        ScheduleError::Conflict(_) => Problem::conflict("schedule-busy", e.to_string()),
        ScheduleError::Unavailable(_) => Problem::unavailable(e.to_string(), 1),
    }
}

async fn apply(bridge: &Bridge, caller: &Caller, op: Op, raw: &[u8]) -> Result<Response> {
    let v = schedules::apply(&bridge.rt, &caller.tenant, op, raw)
        .await
        .map_err(problem)?;
    Ok(Json(v).into_response())
}

/// `GET /v1/schedules`
pub(crate) async fn list(State(bridge): State<Bridge>, caller: Caller) -> Result<Response> {
    apply(&bridge, &caller, Op::List, b"").await
}

/// `GET /v1/schedules/{name}`
pub(crate) async fn get(
    State(bridge): State<Bridge>,
    caller: Caller,
    Path(name): Path<String>,
) -> Result<Response> {
    apply(&bridge, &caller, Op::Get(name), b"").await
}

/// `PUT /v1/schedules/{name}`: create or replace.
pub(crate) async fn put(
    State(bridge): State<Bridge>,
    caller: Caller,
    Path(name): Path<String>,
    raw: std::result::Result<Bytes, BytesRejection>,
) -> Result<Response> {
    caller.require_write()?;
    let raw = body(raw, bridge.config.max_body_bytes)?;
    apply(&bridge, &caller, Op::Put(name), &raw).await
}

/// `DELETE /v1/schedules/{name}`
pub(crate) async fn delete(
    State(bridge): State<Bridge>,
    caller: Caller,
    Path(name): Path<String>,
) -> Result<Response> {
    caller.require_write()?;
    apply(&bridge, &caller, Op::Delete(name), b"").await
}

/// `POST /v1/schedules/{name}/pause`
pub(crate) async fn pause(
    State(bridge): State<Bridge>,
    caller: Caller,
    Path(name): Path<String>,
) -> Result<Response> {
    caller.require_write()?;
    apply(&bridge, &caller, Op::Pause(name), b"").await
}

/// `POST /v1/schedules/{name}/resume`
pub(crate) async fn resume(
    State(bridge): State<Bridge>,
    caller: Caller,
    Path(name): Path<String>,
) -> Result<Response> {
    caller.require_write()?;
    apply(&bridge, &caller, Op::Resume(name), b"").await
}

/// `POST /v1/schedules/{name}/trigger`
pub(crate) async fn trigger(
    State(bridge): State<Bridge>,
    caller: Caller,
    Path(name): Path<String>,
) -> Result<Response> {
    caller.require_write()?;
    apply(&bridge, &caller, Op::Trigger(name), b"").await
}
