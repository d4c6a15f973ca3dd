//! The runs: `POST /v1/runs` (submit a task), `GET /v1/runs` (the list), `GET /v1/runs/{id}`,
//! its history and its blobs.

use std::collections::HashMap;
use std::time::Duration;

use axum::Json;
use axum::body::Body;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use kedge_app::inputs;
use kedge_app::tasks::{Answer, Submission, SubmitError};
use kedge_core::RunStatus;
use kedge_core::event::{Digest, DigestError};
use kedge_core::ids::RunId;
use kedge_core::task::{MAX_TASK_BYTES, TaskSubmission};
use kedge_journal::{BlobError, blob};
use kedge_runtime::projection::RunSummary;
use serde_json::{Value, json};
use tracing::Instrument;

use crate::Bridge;
use crate::auth::Caller;
use crate::problem::Problem;
use crate::view::{self, Links};

use super::{
    Result, accepted, body, check_owner, fold, idempotency_key, number, owned_run, page_size,
    query, run_id,
};

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
    crate::quota::admit_in_fleet(&bridge.rt, &caller.tenant, &task, &msg_id).await?;
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
    let answer = kedge_app::tasks::submit_traced(
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
        Ok(Answer::Rejected { error }) => Err(crate::quota::rejected(error)),
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
