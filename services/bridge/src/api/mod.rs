//! The JSON endpoints under `/v1` and the health checks.
//!
//! Every handler: authenticate ([`Caller`]), parse its inputs by hand (so an error names the field),
//! check the run's tenant (another tenant's run is a 404), then read the journal or append an
//! input. Inputs carry deterministic `Nats-Msg-Id`s: `answer:<question_id>`, `cancel:<run_id>`,
//! `msg:<run_id>:<Idempotency-Key>`; a task's is `<tenant>/<Idempotency-Key>`, so two tenants
//! using the same key never collide.

use std::collections::HashMap;

use axum::Json;
use axum::extract::Query;
use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use kedge_app::inputs;
use kedge_core::RunState;
use kedge_core::ids::RunId;
use kedge_journal::Recorded;
use serde_json::{Map, Value};

use crate::Bridge;
use crate::auth::Caller;
use crate::problem::Problem;

mod events;
mod health;
mod run_inputs;
mod runs;
pub(crate) mod schedules;

pub(crate) use events::{events, sse_ticket};
pub(crate) use health::{healthz, method_not_allowed, not_found, readyz, whoami};
pub(crate) use run_inputs::{answer, approve, callback, cancel, message, resolve};
pub(crate) use runs::{blob, get_run, history, list, submit};

type Result<T, E = Problem> = std::result::Result<T, E>;

/// Longest accepted `Idempotency-Key`.
const MAX_KEY: usize = 200;
const DEFAULT_PAGE: usize = 100;
const MAX_PAGE: usize = 1000;

// ---------------------------------------------------------------------------------------------
// Input parsing.
// ---------------------------------------------------------------------------------------------

pub(crate) fn body(
    body: std::result::Result<Bytes, BytesRejection>,
    limit: usize,
) -> Result<Bytes> {
    body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            Problem::too_large(limit)
        } else {
            Problem::malformed("body", rejection.body_text())
        }
    })
}

/// A JSON object body with only `known` fields (`optional_body`: an empty body is `{}`).
fn object(bytes: &[u8], known: &[&str], optional_body: bool) -> Result<Map<String, Value>> {
    if optional_body && bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(Map::new());
    }
    let value: Value = serde_json::from_slice(bytes)
        .map_err(|e| Problem::malformed("body", format!("not valid JSON: {e}")))?;
    let Value::Object(obj) = value else {
        return Err(Problem::malformed("body", "must be a JSON object"));
    };
    if let Some(k) = obj.keys().find(|k| !known.contains(&k.as_str())) {
        return Err(Problem::invalid(
            k.clone(),
            format!("unknown field; expected one of {}", known.join(", ")),
        ));
    }
    Ok(obj)
}

/// A string field: required non-blank (unless `required` is false), at most `max` bytes.
fn text(
    obj: &Map<String, Value>,
    name: &str,
    required: bool,
    max: usize,
) -> Result<Option<String>> {
    match obj.get(name) {
        None | Some(Value::Null) if required => Err(Problem::invalid(name, "is required")),
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => {
            if s.trim().is_empty() {
                return Err(Problem::invalid(name, "must not be empty"));
            }
            if s.len() > max {
                return Err(Problem::invalid(
                    name,
                    format!("{} bytes is over the {max}-byte limit", s.len()),
                ));
            }
            Ok(Some(s.clone()))
        }
        Some(_) => Err(Problem::invalid(name, "must be a string")),
    }
}

pub(crate) fn run_id(raw: &str) -> Result<RunId> {
    raw.parse()
        .map_err(|e: kedge_core::ids::IdError| Problem::malformed("run_id", e.to_string()))
}

/// The `Idempotency-Key` header, if any: 1–200 printable ASCII characters without spaces.
fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>> {
    let Some(v) = headers.get("idempotency-key") else {
        return Ok(None);
    };
    let bad = || {
        Problem::malformed(
            "Idempotency-Key",
            format!("must be 1-{MAX_KEY} printable ASCII characters without spaces"),
        )
    };
    let s = v.to_str().map_err(|_| bad())?;
    if s.is_empty() || s.len() > MAX_KEY || !s.chars().all(|c| c.is_ascii_graphic()) {
        return Err(bad());
    }
    Ok(Some(s.to_owned()))
}

fn number(params: &HashMap<String, String>, name: &str) -> Result<Option<u64>> {
    params
        .get(name)
        .map(|v| {
            v.parse::<u64>().map_err(|_| {
                Problem::malformed(name, format!("`{v}` is not a non-negative integer"))
            })
        })
        .transpose()
}

fn page_size(params: &HashMap<String, String>) -> Result<usize> {
    match number(params, "limit")? {
        None => Ok(DEFAULT_PAGE),
        Some(n) if (1..=MAX_PAGE as u64).contains(&n) => Ok(n as usize),
        Some(n) => Err(Problem::invalid(
            "limit",
            format!("{n} is not between 1 and {MAX_PAGE}"),
        )),
    }
}

fn query(
    q: std::result::Result<
        Query<HashMap<String, String>>,
        axum::extract::rejection::QueryRejection,
    >,
) -> Result<HashMap<String, String>> {
    q.map(|Query(p)| p)
        .map_err(|e| Problem::malformed("query", e.body_text()))
}

/// `202 Accepted` with a JSON body.
fn accepted(body: Value) -> Response {
    (StatusCode::ACCEPTED, Json(body)).into_response()
}

// ---------------------------------------------------------------------------------------------
// Reading a run.
// ---------------------------------------------------------------------------------------------

/// The run's whole journal, if the run exists and belongs to the caller's tenant (else 404).
async fn owned_run(bridge: &Bridge, caller: &Caller, run: &RunId) -> Result<Vec<Recorded>> {
    let events = bridge.rt.journal.read(run, 0).await?;
    inputs::check_owner(&caller.tenant, run, &events).map_err(refused)?;
    bridge.tenants.remember(run, &caller.tenant);
    Ok(events)
}

/// Checks the run's tenant without reading its journal (cached after the first time).
async fn check_owner(bridge: &Bridge, caller: &Caller, run: &RunId) -> Result<()> {
    match bridge.tenants.get(run).await? {
        Some(t) if t == caller.tenant => Ok(()),
        _ => Err(Problem::not_found(format!("no run {run}"))),
    }
}

fn fold(run: &RunId, events: &[Recorded]) -> Result<RunState> {
    kedge_core::fold(events.iter().map(|r| (r.seq, &r.envelope))).map_err(|e| {
        tracing::error!(run_id = %run, error = %e, "journal does not fold");
        Problem::internal(format!("the journal of {run} does not fold: {e}"))
    })
}

/// The HTTP form of an input's refusal.
fn refused(r: inputs::Refusal) -> Problem {
    use inputs::Refusal as R;
    match r {
        R::NotFound { field, reason } => {
            let p = Problem::not_found(reason);
            match field {
                Some(f) => p.with_field(f),
                None => p,
            }
        }
        R::Conflict {
            code,
            field,
            reason,
        } => {
            let p = Problem::conflict(code, reason);
            match field {
                Some(f) => p.with_field(f),
                None => p,
            }
        }
        R::Invalid { field, reason } => Problem::invalid(field, reason),
        R::Gone { field, reason } => Problem::new(
            StatusCode::GONE,
            "callback-expired",
            "Callback expired",
            reason,
        )
        .with_field(field),
        R::Unavailable { reason } => Problem::unavailable(reason, 1),
        R::Internal { reason } => Problem::internal(reason),
    }
}
