//! The JSON endpoints under `/v1` and the health checks.
//!
//! Every handler: authenticate ([`Caller`]), parse its inputs by hand (so an error names the field),
//! check the run's tenant (another tenant's run is a 404), then read the journal or append an
//! input. Inputs carry deterministic `Nats-Msg-Id`s: `answer:<question_id>`, `cancel:<run_id>`,
//! `msg:<run_id>:<Idempotency-Key>`; a task's is `<tenant>/<Idempotency-Key>`, so two tenants
//! using the same key never collide.

use std::collections::HashMap;
use std::time::Duration;

use axum::Json;
use axum::body::Body;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use kedge_core::event::{Digest, DigestError};
use kedge_core::ids::{QuestionId, RunId};
use kedge_core::task::{MAX_INPUT_BYTES, MAX_TASK_BYTES, TaskSubmission};
use kedge_core::{RunState, RunStatus};
use kedge_journal::{BlobError, Recorded, blob};
use kedge_runtime::inputs;
use kedge_runtime::tasks::{Answer, Submission, SubmitError};
use serde_json::{Map, Value, json};
use tracing::Instrument;

use crate::Bridge;
use crate::auth::Caller;
use crate::problem::Problem;
use crate::projection::RunSummary;
use crate::sse::Connection;
use crate::view::{self, Links};

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

// ---------------------------------------------------------------------------------------------
// Handlers.
// ---------------------------------------------------------------------------------------------

/// `POST /v1/runs`
pub(crate) async fn submit(
    State(bridge): State<Bridge>,
    caller: Caller,
    headers: HeaderMap,
    raw: std::result::Result<Bytes, BytesRejection>,
) -> Result<Response> {
    caller.require_write()?;
    let raw = body(raw, bridge.config.max_body_bytes)?;
    if raw.len() > MAX_TASK_BYTES {
        return Err(Problem::too_large(MAX_TASK_BYTES));
    }
    let task = TaskSubmission::parse(&raw).map_err(|r| {
        if r.field == "body" {
            Problem::malformed("body", r.reason)
        } else {
            Problem::invalid(r.field, r.reason)
        }
    })?;
    let key = match idempotency_key(&headers)? {
        Some(k) => k,
        None => uuid::Uuid::now_v7().simple().to_string(),
    };
    // The tenant's quotas, after the request proved well-formed (a bad request is a 4xx of its
    // own, never a 429).
    bridge.quotas.start_run(&caller.tenant)?;
    let active_cap = bridge.config.max_active_runs;
    if active_cap > 0 {
        let runs = bridge
            .projection
            .list(&caller.tenant)
            .await
            .map_err(|e| Problem::unavailable(e.to_string(), 1))?;
        let active = runs.iter().filter(|r| !r.finished).count();
        if active >= active_cap {
            return Err(crate::quota::too_many(
                format!(
                    "tenant {} has {active} unfinished runs, its limit is {active_cap}",
                    caller.tenant
                ),
                10,
            ));
        }
    }
    let msg_id = format!("{}/{key}", caller.tenant);
    let submission = Submission {
        task: &task,
        key: &msg_id,
        tenant: caller.tenant.as_str(),
        caller: Some(&caller.name),
    };
    let wait = Duration::from_millis(bridge.config.intake_wait_ms);
    // The client's W3C trace context: this submit joins it, and the task carries it on (as this
    // span's context when spans are exported, else as it came) to intake and the run.
    let incoming = kedge_runtime::trace::accept(
        headers
            .get(kedge_runtime::trace::TRACEPARENT_HEADER)
            .and_then(|v| v.to_str().ok()),
    );
    let span = tracing::info_span!("submit", agent = %task.agent, tenant = %caller.tenant);
    kedge_runtime::trace::set_parent(&span, incoming.as_deref());
    let traceparent = kedge_runtime::trace::of_span(&span).or(incoming);
    let answer = kedge_runtime::tasks::submit_traced(
        &bridge.rt.client,
        &kedge_core::subjects::task_for(&task.agent, &caller.tenant),
        raw,
        &submission,
        traceparent.as_deref(),
        wait,
    )
    .instrument(span)
    .await;
    match answer {
        Ok(Answer::Accepted { run_id }) => {
            let links = Links::for_run(&run_id);
            let mut response = accepted(json!({
                "run_id": run_id,
                "idempotency_key": key,
                "links": links,
            }));
            if let Ok(v) = HeaderValue::from_str(&links.this) {
                response.headers_mut().insert(header::LOCATION, v);
            }
            Ok(response)
        }
        Ok(Answer::Rejected { error }) => Err(Problem::invalid(error.field, error.reason)),
        Err(SubmitError::NoAnswer(_)) => Err(Problem::unavailable(
            format!(
                "the task is queued but intake did not answer within {wait:?}; repeat the request \
                 with the same Idempotency-Key ({key}) to learn its run"
            ),
            2,
        )),
        Err(SubmitError::DuplicateWithoutRun(_)) => Err(Problem::conflict(
            "idempotency-key-used",
            format!(
                "the Idempotency-Key {key} was used by an earlier task that made no run (it was \
                 rejected, or is still being processed); retry later or use a new key"
            ),
        )
        .with_field("Idempotency-Key")),
        Err(e @ (SubmitError::Publish(_) | SubmitError::BadAnswer(_))) => {
            Err(Problem::unavailable(e.to_string(), 1))
        }
    }
}

/// `GET /v1/runs`
pub(crate) async fn list(
    State(bridge): State<Bridge>,
    caller: Caller,
    params: std::result::Result<
        Query<HashMap<String, String>>,
        axum::extract::rejection::QueryRejection,
    >,
) -> Result<Response> {
    let params = query(params)?;
    let limit = page_size(&params)?;
    let statuses: Option<Vec<RunStatus>> = params
        .get("status")
        .map(|v| {
            v.split(',')
                .map(|s| {
                    serde_json::from_value::<RunStatus>(Value::String(s.trim().to_owned())).map_err(
                        |_| {
                            Problem::invalid(
                                "status",
                                format!(
                                    "`{s}` is not a run status ({})",
                                    RunStatus::ALL
                                        .iter()
                                        .map(|s| s.as_str())
                                        .collect::<Vec<_>>()
                                        .join(", ")
                                ),
                            )
                        },
                    )
                })
                .collect()
        })
        .transpose()?;
    let agent: Option<kedge_core::ids::AgentName> = params
        .get("agent")
        .map(|a| {
            a.parse()
                .map_err(|e: kedge_core::ids::IdError| Problem::invalid("agent", e.to_string()))
        })
        .transpose()?;
    let cursor = params.get("cursor").map(|c| parse_cursor(c)).transpose()?;
    let mut runs = bridge.projection.list(&caller.tenant).await.map_err(|e| {
        if e.is_retryable() {
            Problem::unavailable(e.to_string(), 1)
        } else {
            Problem::internal(e.to_string())
        }
    })?;
    runs.retain(|r| {
        statuses.as_ref().is_none_or(|s| s.contains(&r.status))
            && agent.as_ref().is_none_or(|a| &r.agent == a)
    });
    // Newest first; the cursor is the position of the last run of the previous page.
    runs.sort_by_key(|r| std::cmp::Reverse(sort_key(r)));
    if let Some(c) = &cursor {
        runs.retain(|r| sort_key(r) < (c.0, c.1.clone()));
    }
    let more = runs.len() > limit;
    runs.truncate(limit);
    let next_cursor = more
        .then(|| {
            runs.last()
                .map(|r| format!("{}.{}", sort_key(r).0, r.run_id))
        })
        .flatten();
    let items: Vec<Value> = runs
        .iter()
        .map(|r| {
            let mut v = serde_json::to_value(r).unwrap_or(Value::Null);
            if let Some(o) = v.as_object_mut() {
                o.insert("links".into(), json!(Links::for_run(&r.run_id)));
            }
            v
        })
        .collect();
    Ok(Json(json!({ "runs": items, "next_cursor": next_cursor })).into_response())
}

fn sort_key(r: &RunSummary) -> (i128, String) {
    (
        r.created_at.0.unix_timestamp_nanos(),
        r.run_id.as_str().to_owned(),
    )
}

/// A cursor `<created_at unix nanos>.<run_id>`.
fn parse_cursor(c: &str) -> Result<(i128, String)> {
    let bad = || Problem::malformed("cursor", "not a cursor this API returned");
    let (nanos, run) = c.split_once('.').ok_or_else(bad)?;
    let nanos: i128 = nanos.parse().map_err(|_| bad())?;
    let run: RunId = run.parse().map_err(|_| bad())?;
    Ok((nanos, run.as_str().to_owned()))
}

/// `GET /v1/runs/{id}`
pub(crate) async fn get_run(
    State(bridge): State<Bridge>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Response> {
    let run = run_id(&id)?;
    let events = owned_run(&bridge, &caller, &run).await?;
    let state = fold(&run, &events)?;
    let mut v = view::run_view(&state, &events);
    view::add_children(&bridge.rt.journal, &state, &mut v).await;
    Ok(Json(v).into_response())
}

/// `GET /v1/runs/{id}/history`
pub(crate) async fn history(
    State(bridge): State<Bridge>,
    caller: Caller,
    Path(id): Path<String>,
    params: std::result::Result<
        Query<HashMap<String, String>>,
        axum::extract::rejection::QueryRejection,
    >,
) -> Result<Response> {
    let run = run_id(&id)?;
    let params = query(params)?;
    let after = number(&params, "after")?.unwrap_or(0);
    let limit = page_size(&params)?;
    check_owner(&bridge, &caller, &run).await?;
    let (public, more) = inputs::public_page(&bridge.rt, &run, after, limit).await?;
    let page: Vec<Value> = public.iter().map(view::event_json).collect();
    let next_after = if more {
        public.last().map(|r| r.seq)
    } else {
        None
    };
    Ok(Json(json!({ "events": page, "next_after": next_after })).into_response())
}

/// `GET /v1/runs/{id}/blobs/{digest}`: the data of one of the run's events held by reference
/// (`data_ref` in the stored message; `/history` and SSE already show it in place), as stored
/// in `kedge_blobs` and checked against its digest. Only a blob the run's journal refers to is
/// served, and only to the run's tenant.
pub(crate) async fn blob(
    State(bridge): State<Bridge>,
    caller: Caller,
    Path((id, digest)): Path<(String, String)>,
) -> Result<Response> {
    let run = run_id(&id)?;
    let digest: Digest = digest
        .parse()
        .map_err(|e: DigestError| Problem::malformed("digest", e.to_string()))?;
    check_owner(&bridge, &caller, &run).await?;
    let references = bridge.rt.journal.blob_references(&run).await?;
    let Some((_, reference)) = references.into_iter().find(|(_, r)| r.digest == digest) else {
        return Err(Problem::not_found(format!(
            "run {run} holds no blob {digest} (an event small enough stays in the journal: see /history)"
        )));
    };
    let bytes = match bridge.rt.journal.blobs().get(&run, &reference).await {
        Ok(bytes) => bytes,
        Err(BlobError::Unavailable(reason)) => return Err(Problem::unavailable(reason, 1)),
        Err(e) => return Err(Problem::internal(e.to_string())),
    };
    // Only the type the runtime stores; a reference someone else wrote names no other.
    let media_type = if reference.media_type == blob::EVENT_DATA {
        blob::EVENT_DATA
    } else {
        "application/octet-stream"
    };
    let mut response = Body::from(bytes).into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(media_type));
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    if let Ok(etag) = HeaderValue::from_str(&format!("\"{digest}\"")) {
        headers.insert(header::ETAG, etag);
    }
    headers.insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("private, max-age=31536000, immutable"),
    );
    Ok(response)
}

/// `GET /v1/runs/{id}/events`
pub(crate) async fn events(
    State(bridge): State<Bridge>,
    caller: Caller,
    Path(id): Path<String>,
    headers: HeaderMap,
    params: std::result::Result<
        Query<HashMap<String, String>>,
        axum::extract::rejection::QueryRejection,
    >,
) -> Result<Response> {
    let run = run_id(&id)?;
    let params = query(params)?;
    // A browser reconnects to the same URL with Last-Event-ID: the header wins over `after`.
    let after = match headers.get("last-event-id") {
        Some(v) => {
            let s = v.to_str().unwrap_or("").trim();
            if s.is_empty() {
                0
            } else {
                s.parse::<u64>().map_err(|_| {
                    Problem::malformed(
                        "Last-Event-ID",
                        format!("`{s}` is not an event id (a journal sequence)"),
                    )
                })?
            }
        }
        None => number(&params, "after")?.unwrap_or(0),
    };
    let tenant_slot = bridge.quotas.open_stream(&caller.tenant)?;
    let permit = bridge.sse_slots.clone().try_acquire_owned().map_err(|_| {
        Problem::unavailable("this bridge serves its maximum of SSE connections", 2)
    })?;
    let events = match owned_run(&bridge, &caller, &run).await {
        Ok(e) => e,
        // Broker trouble must not make a browser's EventSource give up (it does on any status
        // but 200 and 204): answer an empty stream with the retry hint, so it reconnects.
        Err(p) if p.status == 503 => {
            let body = format!("retry: {}\n\n", bridge.config.sse_retry_ms);
            return Ok(sse_response(Body::from(body)));
        }
        Err(p) => return Err(p),
    };
    let state = fold(&run, &events)?;
    let conn = Connection {
        hub: bridge.hub.clone(),
        journal: bridge.rt.journal.clone(),
        run,
        after,
        events,
        state,
        retry_ms: bridge.config.sse_retry_ms,
        heartbeat: Duration::from_millis(bridge.config.heartbeat_ms),
        shutdown: bridge.shutdown.clone(),
        permit,
        tenant_slot,
    };
    if conn.nothing_to_send() {
        return Ok(StatusCode::NO_CONTENT.into_response());
    }
    Ok(sse_response(Body::from_stream(conn.into_body())))
}

fn sse_response(body: Body) -> Response {
    let mut r = Response::new(body);
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    r
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

/// `POST /v1/runs/{id}/messages`
pub(crate) async fn message(
    State(bridge): State<Bridge>,
    caller: Caller,
    Path(id): Path<String>,
    headers: HeaderMap,
    raw: std::result::Result<Bytes, BytesRejection>,
) -> Result<Response> {
    caller.require_write()?;
    let run = run_id(&id)?;
    let raw = body(raw, bridge.config.max_body_bytes)?;
    let obj = object(&raw, &["text"], false)?;
    let text = text(&obj, "text", true, MAX_INPUT_BYTES)?.unwrap_or_default();
    let key = idempotency_key(&headers)?;
    let events = owned_run(&bridge, &caller, &run).await?;
    let done = inputs::message(&bridge.rt, &run, &events, text, key.as_deref())
        .await
        .map_err(refused)?;
    Ok(accepted(
        json!({ "run_id": run, "seq": done.seq, "duplicate": done.duplicate, "links": Links::for_run(&run) }),
    ))
}

/// `POST /v1/runs/{id}/answers/{question_id}`
pub(crate) async fn answer(
    State(bridge): State<Bridge>,
    caller: Caller,
    Path((id, qid)): Path<(String, String)>,
    raw: std::result::Result<Bytes, BytesRejection>,
) -> Result<Response> {
    caller.require_write()?;
    let run = run_id(&id)?;
    let question: QuestionId = qid
        .parse()
        .map_err(|e: kedge_core::ids::IdError| Problem::malformed("question_id", e.to_string()))?;
    let raw = body(raw, bridge.config.max_body_bytes)?;
    let obj = object(&raw, &["answer"], false)?;
    let text = text(&obj, "answer", true, MAX_INPUT_BYTES)?.unwrap_or_default();
    let events = owned_run(&bridge, &caller, &run).await?;
    let done = inputs::answer(&bridge.rt, &run, &events, &question, text)
        .await
        .map_err(refused)?;
    let mut body = json!({ "run_id": run, "question_id": question, "duplicate": done.duplicate });
    if done.seq > 0 {
        body["seq"] = json!(done.seq);
    }
    Ok(accepted(body))
}

/// `POST /v1/runs/{id}/cancel`
pub(crate) async fn cancel(
    State(bridge): State<Bridge>,
    caller: Caller,
    Path(id): Path<String>,
    raw: std::result::Result<Bytes, BytesRejection>,
) -> Result<Response> {
    caller.require_write()?;
    let run = run_id(&id)?;
    let raw = body(raw, bridge.config.max_body_bytes)?;
    let obj = object(&raw, &["reason"], true)?;
    let reason = text(&obj, "reason", false, 4096)?.unwrap_or_else(|| "cancelled over HTTP".into());
    let events = owned_run(&bridge, &caller, &run).await?;
    let done = inputs::cancel(&bridge.rt, &run, &events, reason, Some(caller.name.clone()))
        .await
        .map_err(refused)?;
    Ok(accepted(
        json!({ "run_id": run, "seq": done.seq, "duplicate": done.duplicate, "links": Links::for_run(&run) }),
    ))
}

/// `POST /v1/runs/{id}/approvals/{approval_id}`: a decision on an approval, with the argument
/// digest the approver was shown; the caller (its token's name) is the approver. Needs a token
/// with the `approve` scope.
pub(crate) async fn approve(
    State(bridge): State<Bridge>,
    caller: Caller,
    Path((id, aid)): Path<(String, String)>,
    raw: std::result::Result<Bytes, BytesRejection>,
) -> Result<Response> {
    caller.require_approve()?;
    let run = run_id(&id)?;
    let approval: kedge_core::ids::ApprovalId = aid
        .parse()
        .map_err(|e: kedge_core::ids::IdError| Problem::malformed("approval_id", e.to_string()))?;
    let raw = body(raw, bridge.config.max_body_bytes)?;
    let obj = object(&raw, &["verdict", "args_digest", "comment"], false)?;
    let verdict = match text(&obj, "verdict", true, 16)?.as_deref() {
        Some("approve") => kedge_core::event::Verdict::Approve,
        Some("deny") => kedge_core::event::Verdict::Deny,
        _ => {
            return Err(Problem::invalid(
                "verdict",
                "must be \"approve\" or \"deny\"",
            ));
        }
    };
    let args_digest = text(&obj, "args_digest", true, 80)?
        .unwrap_or_default()
        .parse::<kedge_core::event::Digest>()
        .map_err(|e| Problem::invalid("args_digest", e.to_string()))?;
    let comment = text(&obj, "comment", false, 4096)?;
    // Tenant isolation: another tenant's run is a 404.
    owned_run(&bridge, &caller, &run).await?;
    let request = kedge_runtime::approvals::DecisionRequest {
        approval_id: approval.clone(),
        verdict,
        args_digest,
        comment,
    };
    let seq = inputs::approve(&bridge.rt, &run, &caller.name, request)
        .await
        .map_err(refused)?;
    Ok(accepted(
        json!({ "run_id": run, "approval_id": approval, "seq": seq, "links": Links::for_run(&run) }),
    ))
}

/// `POST /v1/runs/{id}/operations/{op}/resolve`: a person's verdict on an operation whose
/// outcome is ambiguous (its runner died mid-effect and the tool has no confirm query):
/// `completed` (with the result to give the model), `retry` (run it again under the same
/// operation id) or `failed` (with the reason). Journals `outcome.resolved`; needs `write`.
pub(crate) async fn resolve(
    State(bridge): State<Bridge>,
    caller: Caller,
    Path((id, op)): Path<(String, String)>,
    raw: std::result::Result<Bytes, BytesRejection>,
) -> Result<Response> {
    use kedge_core::event::Resolution;
    caller.require_write()?;
    let run = run_id(&id)?;
    let op: kedge_core::ids::OperationId = op
        .parse()
        .map_err(|e: kedge_core::ids::IdError| Problem::malformed("op", e.to_string()))?;
    let raw = body(raw, bridge.config.max_body_bytes)?;
    let obj = object(&raw, &["resolution", "content", "reason"], false)?;
    let resolution = match text(&obj, "resolution", true, 16)?.as_deref() {
        Some("retry") => Resolution::Retry,
        Some("completed") => Resolution::Completed {
            content: text(&obj, "content", true, MAX_INPUT_BYTES)?.unwrap_or_default(),
        },
        Some("failed") => Resolution::Failed {
            reason: text(&obj, "reason", true, 4096)?.unwrap_or_default(),
        },
        _ => {
            return Err(Problem::invalid(
                "resolution",
                "must be \"completed\", \"retry\" or \"failed\"",
            ));
        }
    };
    let events = owned_run(&bridge, &caller, &run).await?;
    let appended = inputs::resolve(
        &bridge.rt,
        &run,
        &events,
        &op,
        resolution,
        caller.name.clone(),
    )
    .await
    .map_err(refused)?;
    Ok(accepted(
        json!({ "run_id": run, "op": op, "seq": appended.seq, "duplicate": appended.duplicate, "links": Links::for_run(&run) }),
    ))
}

/// `POST /v1/runs/{id}/sse-ticket`: an SSE ticket for the run's event stream, as an `HttpOnly;
/// SameSite=Strict` cookie scoped to `/v1/runs/{id}/events` ([`crate::ticket`]), so a browser's
/// `EventSource` needs no token in its URL. Any scope may ask (it only reads).
pub(crate) async fn sse_ticket(
    State(bridge): State<Bridge>,
    caller: Caller,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Result<Response> {
    let run = run_id(&id)?;
    check_owner(&bridge, &caller, &run).await?;
    let (ticket, expires) = bridge
        .auth
        .issue_ticket(&caller, &run, crate::ticket::now_unix())
        .ok_or_else(|| Problem::internal("no ticket key for this caller"))?;
    // Behind a TLS-terminating proxy the cookie is marked Secure (it only ever names the proxy's
    // own scheme, so a forged header can only make the cookie stricter).
    let secure = headers
        .get("x-forwarded-proto")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"https"));
    let ttl = bridge.auth.ticket_ttl();
    let cookie = crate::ticket::set_cookie(&run, &ticket, ttl, secure);
    let expires_at = time::OffsetDateTime::from_unix_timestamp(expires as i64)
        .ok()
        .and_then(|t| {
            t.format(&time::format_description::well_known::Rfc3339)
                .ok()
        });
    let mut response = Json(json!({
        "run_id": run,
        "expires_at": expires_at,
        "ttl_secs": ttl.as_secs(),
        "events": Links::for_run(&run).events,
    }))
    .into_response();
    let h = response.headers_mut();
    h.insert(
        header::SET_COOKIE,
        HeaderValue::from_str(&cookie).map_err(|e| Problem::internal(e.to_string()))?,
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    Ok(response)
}

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

/// `POST /v1/callbacks/{key}`: an external event for a correlation key; the body (any JSON) is
/// the payload. `Kedge-Delivery-Id` identifies a delivery for deduplication.
pub(crate) async fn callback(
    State(bridge): State<Bridge>,
    caller: Caller,
    Path(key): Path<String>,
    headers: HeaderMap,
    raw: std::result::Result<Bytes, BytesRejection>,
) -> Result<Response> {
    use kedge_runtime::callbacks::Delivery;
    caller.require_write()?;
    let raw = body(raw, bridge.config.max_body_bytes)?;
    let payload: Value = if raw.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&raw).map_err(|e| Problem::malformed("body", e.to_string()))?
    };
    let delivery_id = headers
        .get("Kedge-Delivery-Id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let delivery = inputs::callback(
        &bridge.rt,
        &caller.tenant,
        &key,
        payload,
        delivery_id.as_deref(),
    )
    .await
    .map_err(refused)?;
    let body = serde_json::to_value(&delivery).unwrap_or(Value::Null);
    Ok(match delivery {
        Delivery::Accepted { .. } | Delivery::Early { .. } => accepted(body),
        Delivery::Duplicate { .. } => Json(body).into_response(),
        Delivery::Expired { .. } => Problem::new(
            StatusCode::GONE,
            "callback-expired",
            "Callback expired",
            format!("the deadline of callback key {key} has passed"),
        )
        .with_field("key")
        .into_response(),
        Delivery::Closed { .. } => {
            Problem::conflict("run-ended", format!("the run waiting for {key} has ended"))
                .with_field("key")
                .into_response()
        }
        Delivery::UnknownKey { .. } => Problem::not_found(format!(
            "no run has callback key {key}; the callback was recorded"
        ))
        .with_field("key")
        .into_response(),
    })
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
