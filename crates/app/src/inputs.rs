//! The inputs an outside party may append to a run, in one place: each is built, validated against
//! the run's state and given its deduplication id (`Nats-Msg-Id`) here, for a caller acting for
//! one tenant. The HTTP bridge and the tenant gateway (NATS) are thin shells over these
//! functions, so both refuse the same things for the same reasons.
//!
//! The caller has authenticated the tenant (a bearer token, or the server's account); every
//! function first checks that the run belongs to that tenant and treats another tenant's run as
//! one that does not exist. Refusals carry an HTTP-like status ([`Refusal::status`]).

use kedge_core::Input;
use kedge_core::InputEnvelope;
use kedge_core::RunStatus;
use kedge_core::event::{
    CancelRequested, Draft, Event, OutcomeResolved, QuestionAnswered, Resolution, Timestamp,
    UserMessage,
};
use kedge_core::fold::OpStatus;
use kedge_core::ids::{CallbackKey, OperationId, QuestionId, RunId, TenantId};

pub use kedge_core::ids::InputId;
use kedge_core::{RunState, fold};
use kedge_journal::{JournalError, Recorded};
use kedge_runtime::Runtime;
use serde::Serialize;

use crate::approvals::DecisionRequest;
use crate::callbacks::{CallbackError, Delivery};

/// Largest text of a message or an answer, in bytes.
pub const MAX_TEXT_BYTES: usize = kedge_core::task::MAX_INPUT_BYTES;

/// Why an input was not appended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, thiserror::Error)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Refusal {
    /// No such run for this tenant (or no such question, approval, callback key).
    #[error("{reason}")]
    NotFound {
        field: Option<&'static str>,
        reason: String,
    },
    /// The run's state does not take it (`code` names the conflict, e.g. `run-ended`).
    #[error("{reason}")]
    Conflict {
        code: &'static str,
        field: Option<&'static str>,
        reason: String,
    },
    /// The request itself is wrong.
    #[error("{field}: {reason}")]
    Invalid { field: &'static str, reason: String },
    /// The deadline passed (a callback after its expiry).
    #[error("{reason}")]
    Gone { field: &'static str, reason: String },
    /// The broker is unavailable; retry.
    #[error("{reason}")]
    Unavailable { reason: String },
    /// The journal is unreadable.
    #[error("{reason}")]
    Internal { reason: String },
}

impl Refusal {
    /// The HTTP status that says the same.
    pub fn status(&self) -> u16 {
        match self {
            Refusal::NotFound { .. } => 404,
            Refusal::Conflict { .. } => 409,
            Refusal::Invalid { .. } => 422,
            Refusal::Gone { .. } => 410,
            Refusal::Unavailable { .. } => 503,
            Refusal::Internal { .. } => 500,
        }
    }

    fn not_found(field: Option<&'static str>, reason: impl Into<String>) -> Refusal {
        Refusal::NotFound {
            field,
            reason: reason.into(),
        }
    }

    fn conflict(
        code: &'static str,
        field: Option<&'static str>,
        reason: impl Into<String>,
    ) -> Self {
        Refusal::Conflict {
            code,
            field,
            reason: reason.into(),
        }
    }

    fn invalid(field: &'static str, reason: impl Into<String>) -> Refusal {
        Refusal::Invalid {
            field,
            reason: reason.into(),
        }
    }
}

impl From<JournalError> for Refusal {
    fn from(e: JournalError) -> Self {
        Refusal::Unavailable {
            reason: e.to_string(),
        }
    }
}

/// An appended input: its journal sequence, and whether it was a repeat of one already there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Appended {
    pub seq: u64,
    pub duplicate: bool,
}

/// The run's whole journal, if it exists and belongs to `tenant`; otherwise not found.
pub async fn owned_run(
    rt: &Runtime,
    tenant: &TenantId,
    run: &RunId,
) -> Result<Vec<Recorded>, Refusal> {
    let events = rt.journal.read(run, 0).await?;
    check_owner(tenant, run, &events)?;
    Ok(events)
}

/// Not found unless the run exists and belongs to `tenant`; reads only its `run.created`.
pub async fn check_tenant(rt: &Runtime, tenant: &TenantId, run: &RunId) -> Result<(), Refusal> {
    let created = rt
        .journal
        .read_type(run, kedge_core::event::EventType::RunCreated)
        .await?;
    check_owner(tenant, run, &created)
}

/// A page of the run's public events ([`crate::view::is_public`]) after `after`: at most
/// `limit`, and whether more follow. Reads a page (plus one) at a time, not the rest of the
/// run, and reads again only when internal events filtered out made the page short.
pub async fn public_page(
    rt: &Runtime,
    run: &RunId,
    after: u64,
    limit: usize,
) -> Result<(Vec<Recorded>, bool), JournalError> {
    let limit = limit.max(1);
    let mut public: Vec<Recorded> = Vec::new();
    let mut cursor = after;
    loop {
        let want = limit + 1 - public.len();
        let page = rt.journal.read_at_most(run, cursor, want).await?;
        if let Some(last) = page.events.last() {
            cursor = last.seq;
        }
        public.extend(
            page.events
                .into_iter()
                .filter(|r| crate::view::is_public(r.envelope.event_type())),
        );
        if public.len() > limit || !page.more {
            break;
        }
    }
    let more = public.len() > limit;
    public.truncate(limit);
    Ok((public, more))
}

/// Not found unless `events` start with a `run.created` of `tenant`.
pub fn check_owner(tenant: &TenantId, run: &RunId, events: &[Recorded]) -> Result<(), Refusal> {
    match events.first().map(|r| &r.envelope.event) {
        Some(Event::RunCreated(c)) if c.tenant == *tenant => Ok(()),
        _ => Err(Refusal::not_found(None, format!("no run {run}"))),
    }
}

/// The run's state. A journal that does not fold is an internal error (logged).
pub fn state_of(run: &RunId, events: &[Recorded]) -> Result<RunState, Refusal> {
    fold(events.iter().map(|r| (r.seq, &r.envelope))).map_err(|e| {
        tracing::error!(run_id = %run, error = %e, "journal does not fold");
        Refusal::Internal {
            reason: format!("the journal of {run} does not fold: {e}"),
        }
    })
}

fn check_text(field: &'static str, text: &str) -> Result<(), Refusal> {
    if text.len() > MAX_TEXT_BYTES {
        return Err(Refusal::invalid(
            field,
            format!("longer than {MAX_TEXT_BYTES} bytes"),
        ));
    }
    Ok(())
}

async fn append(
    rt: &Runtime,
    run: &RunId,
    input: Input,
    id: &InputId,
) -> Result<Appended, Refusal> {
    append_draft(rt, run, Draft::new(input), id).await
}

async fn append_draft(
    rt: &Runtime,
    run: &RunId,
    draft: Draft<Input>,
    id: &InputId,
) -> Result<Appended, Refusal> {
    let input = InputEnvelope::new(run.clone(), Timestamp::now(), draft);
    let appended = rt.journal.append_input(id, &input).await?;
    Ok(Appended {
        seq: appended.seq,
        duplicate: appended.duplicate,
    })
}

/// A user message (it revives a finished run into a new turn; a cancelled run takes none).
/// `events` is the run's journal, already checked to be the caller's ([`owned_run`]).
pub async fn message(
    rt: &Runtime,
    run: &RunId,
    events: &[Recorded],
    text: String,
    key: Option<&str>,
) -> Result<Appended, Refusal> {
    check_text("text", &text)?;
    let state = state_of(run, events)?;
    if state.status == RunStatus::Cancelled {
        return Err(Refusal::conflict(
            "run-cancelled",
            None,
            format!("run {run} is cancelled; it takes no more messages"),
        ));
    }
    append(
        rt,
        run,
        Input::UserMessage(UserMessage { text }),
        &InputId::message(run, key),
    )
    .await
}

/// The answer to an open question. Repeating the same answer is a duplicate, not an error;
/// another answer to an answered question is a conflict.
pub async fn answer(
    rt: &Runtime,
    run: &RunId,
    events: &[Recorded],
    question: &QuestionId,
    text: String,
) -> Result<Appended, Refusal> {
    check_text("answer", &text)?;
    let state = state_of(run, events)?;
    let not_open =
        |reason: String| Refusal::conflict("question-not-open", Some("question_id"), reason);
    let Some(q) = state.questions.get(question) else {
        return Err(Refusal::not_found(
            Some("question_id"),
            format!("run {run} asked no question {question}"),
        ));
    };
    if let Some(given) = &q.answer {
        if *given == text {
            return Ok(Appended {
                seq: 0,
                duplicate: true,
            });
        }
        return Err(not_open(format!(
            "question {question} was already answered"
        )));
    }
    if q.timed_out {
        return Err(not_open(format!(
            "question {question} timed out unanswered"
        )));
    }
    if state.status.is_terminal() {
        return Err(not_open(format!(
            "run {run} is {}; its questions are closed",
            state.status
        )));
    }
    let appended = append(
        rt,
        run,
        Input::QuestionAnswered(QuestionAnswered {
            question_id: question.clone(),
            answer: text.clone(),
        }),
        &InputId::answer(question),
    )
    .await?;
    if appended.duplicate {
        // Someone answered between our read and our append: the same answer, or a conflict.
        let events = rt.journal.read(run, 0).await?;
        let state = state_of(run, &events)?;
        let same = state
            .questions
            .get(question)
            .and_then(|q| q.answer.as_deref())
            == Some(text.as_str());
        if !same {
            return Err(not_open(format!(
                "question {question} was already answered"
            )));
        }
    }
    Ok(appended)
}

/// A cancel request (cooperative: the run reaches `cancelled` once every operation's fate is
/// known). A run that already ended is a conflict.
pub async fn cancel(
    rt: &Runtime,
    run: &RunId,
    events: &[Recorded],
    reason: String,
    by: Option<String>,
) -> Result<Appended, Refusal> {
    check_text("reason", &reason)?;
    let state = state_of(run, events)?;
    if state.status.is_terminal() {
        return Err(Refusal::conflict(
            "run-ended",
            None,
            format!("run {run} is already {}", state.status),
        ));
    }
    append(
        rt,
        run,
        Input::CancelRequested(CancelRequested { reason, by }),
        &InputId::cancel(run),
    )
    .await
}

/// A person's verdict (`by`) on operation `op`, whose outcome is ambiguous: its runner died
/// mid-effect and the tool could not say whether it happened. Refused unless the operation is
/// the run's and ambiguous now. One verdict per ambiguity: its input id names the operation's
/// dispatch, so the same verdict sent twice (a retried request, a double click) is a duplicate,
/// and a second, different verdict on the same ambiguity is one too (the first stands; the
/// fold ignores a verdict on an operation that is no longer ambiguous).
pub async fn resolve(
    rt: &Runtime,
    run: &RunId,
    events: &[Recorded],
    op: &OperationId,
    resolution: Resolution,
    by: String,
) -> Result<Appended, Refusal> {
    match &resolution {
        Resolution::Retry => {}
        Resolution::Completed { content } => check_text("content", content)?,
        Resolution::Failed { reason } => check_text("reason", reason)?,
    }
    check_text("by", &by)?;
    let state = state_of(run, events)?;
    let not_found = || Refusal::not_found(Some("op"), format!("run {run} has no operation {op}"));
    if op.run() != run {
        return Err(not_found());
    }
    let tool = state.ops.get(op).ok_or_else(not_found)?;
    if tool.result.is_some() || !matches!(tool.status, OpStatus::Ambiguous { .. }) {
        return Err(Refusal::conflict(
            "operation-not-ambiguous",
            Some("op"),
            format!(
                "operation {op} has no ambiguous outcome to resolve (it has a result, or its fate is still being found out)"
            ),
        ));
    }
    let dispatch = tool.dispatches;
    let draft =
        Draft::new(Input::OutcomeResolved(OutcomeResolved { resolution, by })).op(op.clone());
    append_draft(rt, run, draft, &InputId::outcome_resolved(op, dispatch)).await
}

/// An approval decision by `approver` (authenticated by the caller), for a run of the caller's
/// tenant.
pub async fn approve(
    rt: &Runtime,
    run: &RunId,
    approver: &str,
    request: DecisionRequest,
) -> Result<u64, Refusal> {
    crate::approvals::record_decision(rt, run, approver, request)
        .await
        .map_err(|r| match r.code {
            404 => Refusal::not_found(Some("approval_id"), r.reason),
            409 => Refusal::conflict("approval-not-open", Some("approval_id"), r.reason),
            503 => Refusal::Unavailable { reason: r.reason },
            _ => Refusal::Internal { reason: r.reason },
        })
}

/// A callback for `key` from a caller of `tenant`: a key of another tenant's run is answered as
/// unknown, like a key nobody has.
pub async fn callback(
    rt: &Runtime,
    tenant: &TenantId,
    key: &str,
    payload: serde_json::Value,
    delivery_id: Option<&str>,
) -> Result<Delivery, Refusal> {
    if let Some(op) = key.parse::<CallbackKey>().ok().and_then(|k| k.operation())
        && owned_run(rt, tenant, op.run()).await.is_err()
    {
        return Err(Refusal::not_found(
            Some("key"),
            format!("no run waits for callback key {key}"),
        ));
    }
    crate::callbacks::deliver(rt, key, payload, delivery_id)
        .await
        .map_err(|e: CallbackError| Refusal::Unavailable {
            reason: e.to_string(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_map_to_http_statuses() {
        assert_eq!(Refusal::not_found(None, "x").status(), 404);
        assert_eq!(Refusal::conflict("run-ended", None, "x").status(), 409);
        assert_eq!(Refusal::invalid("text", "x").status(), 422);
        let v = serde_json::to_value(Refusal::invalid("text", "too long")).expect("json");
        assert_eq!(v["kind"], "invalid");
        assert_eq!(v["field"], "text");
    }
}
