//! Recording a person's approval decision: shared by the approval service (NATS, approver
//! tokens) and the bridge (HTTP, bearer tokens per tenant). The caller has authenticated the
//! approver; this checks that the run exists and the approval is open, and journals
//! `approval.decided` once per approval (`Nats-Msg-Id` `approval.decided:<approval_id>`).
//! Whether the decision authorises anything is decided by the step on resume.

use kedge_core::Input;
use kedge_core::InputEnvelope;
use kedge_core::event::{ApprovalDecided, Digest, Draft, Timestamp, Verdict};
use kedge_core::fold::ApprovalStatus;
use kedge_core::ids::{ApprovalId, RunId};
use kedge_runtime::Runtime;
use serde::{Deserialize, Serialize};

/// A decision as an approver sends it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecisionRequest {
    pub approval_id: ApprovalId,
    pub verdict: Verdict,
    /// The argument digest the approver was shown.
    pub args_digest: Digest,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comment: Option<String>,
}

/// Why a decision was not recorded, with the HTTP-like status that says so.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {reason}")]
pub struct Refusal {
    pub code: u16,
    pub reason: String,
}

fn refusal(code: u16, reason: impl Into<String>) -> Refusal {
    Refusal {
        code,
        reason: reason.into(),
    }
}

/// Journals `request` for `run` on behalf of `approver`; returns the event's sequence.
pub async fn record_decision(
    rt: &Runtime,
    run: &RunId,
    approver: &str,
    request: DecisionRequest,
) -> Result<u64, Refusal> {
    let events = match rt.journal.read(run, 0).await {
        Ok(events) if !events.is_empty() => events,
        Ok(_) => return Err(refusal(404, format!("no run {run}"))),
        Err(e) => return Err(refusal(503, e.to_string())),
    };
    let state = kedge_core::fold(events.iter().map(|r| (r.seq, &r.envelope)))
        .map_err(|e| refusal(500, e.to_string()))?;
    match state.approvals.get(&request.approval_id) {
        None => {
            return Err(refusal(
                404,
                format!("run {run} has no approval {}", request.approval_id),
            ));
        }
        Some(a) if a.status != ApprovalStatus::Open => {
            return Err(refusal(
                409,
                format!("approval {} is not open", request.approval_id),
            ));
        }
        Some(_) => {}
    }
    let input = InputEnvelope::new(
        run.clone(),
        Timestamp::now(),
        Draft::new(Input::ApprovalDecided(ApprovalDecided {
            approval_id: request.approval_id.clone(),
            verdict: request.verdict,
            args_digest: request.args_digest,
            approver: approver.to_owned(),
            comment: request.comment,
        })),
    );
    let key = crate::inputs::InputId::approval_decided(&request.approval_id);
    match rt.journal.append_input(&key, &input).await {
        Ok(appended) if appended.duplicate => Err(refusal(
            409,
            format!("approval {} was already decided", request.approval_id),
        )),
        Ok(appended) => {
            tracing::info!(run_id = %run, approval = %request.approval_id, %approver, "approval decided");
            Ok(appended.seq)
        }
        Err(e) => Err(refusal(503, e.to_string())),
    }
}
