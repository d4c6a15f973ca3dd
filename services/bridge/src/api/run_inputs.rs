//! The inputs a run is sent: messages, answers, cancel, approvals, resolved operations and
//! callbacks.

use axum::Json;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use kedge_app::inputs;
use kedge_core::ids::QuestionId;
use kedge_core::task::MAX_INPUT_BYTES;
use serde_json::{Value, json};

use crate::Bridge;
use crate::auth::Caller;
use crate::problem::Problem;
use crate::view::Links;

use super::{Result, accepted, body, idempotency_key, object, owned_run, refused, run_id, text};

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
    let request = kedge_app::approvals::DecisionRequest {
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

/// `POST /v1/callbacks/{key}`: an external event for a correlation key; the body (any JSON) is
/// the payload. `Kedge-Delivery-Id` identifies a delivery for deduplication.
pub(crate) async fn callback(
    State(bridge): State<Bridge>,
    caller: Caller,
    Path(key): Path<String>,
    headers: HeaderMap,
    raw: std::result::Result<Bytes, BytesRejection>,
) -> Result<Response> {
    use kedge_app::callbacks::Delivery;
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
