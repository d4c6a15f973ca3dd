//! What clients see of a run: which journal events are public, how an event is rendered (in
//! `/history` and as an SSE frame), and the run view of `GET /v1/runs/{id}`.
//!
//! The same public filter serves `/history` and SSE, so the ids an SSE client collects equal the
//! ids `/history` lists. Principle 9 of the design: connection state (SSE), run state (`status`)
//! and the business result (`result`, with its own `validation`) are reported separately.

use bytes::Bytes;
use kedge_core::event::{
    Budget, Event, EventType, OutputValidation, RunFailed, Timestamp, Usage, WaitReason,
};
use kedge_core::fold::{ApprovalStatus, OpStatus};
use kedge_core::ids::{AgentName, OperationId, RunId, TenantId};
use kedge_core::{RunState, RunStatus};
use kedge_journal::Recorded;
use serde::Serialize;

/// Whether clients see events of this type (in SSE and `/history`).
///
/// Everything a person or a client program can act on or explain a run with is public: the
/// bundle, steps and their attempts (a repeated model call must be visible), the assistant's
/// messages, tool requests, starts and results, questions, approvals, timers, callbacks, status
/// changes and every input a person sent. Not public: `nudge`, the reconciler's wake-up, which
/// changes nothing and says nothing about the run. (Leases and idempotency records are not journal
/// events at all.) The match is exhaustive on purpose: a new event type does not compile until
/// someone decides.
pub fn is_public(t: EventType) -> bool {
    match t {
        EventType::RunCreated
        | EventType::RunStarted
        | EventType::StepStarted
        | EventType::ModelAttempt
        | EventType::StepCompleted
        | EventType::ToolRequested
        | EventType::QuestionAsked
        | EventType::ChildStarted
        | EventType::ApprovalRequested
        | EventType::ApprovalInvalidated
        | EventType::ApprovalExpired
        | EventType::TimerScheduled
        | EventType::CallbackExpected
        | EventType::OutputRejected
        | EventType::RunWaiting
        | EventType::RunCancelling
        | EventType::RunUnknown
        | EventType::RunResumed
        | EventType::RunRevived
        | EventType::RunSucceeded
        | EventType::RunFailed
        | EventType::RunCancelled
        | EventType::UserMessage
        | EventType::ToolStarted
        | EventType::ToolResult
        | EventType::ToolAttempt
        | EventType::QuestionAnswered
        | EventType::ApprovalDecided
        | EventType::TimerFired
        | EventType::CallbackReceived
        | EventType::CancelRequested
        | EventType::OutcomeConfirmed
        | EventType::OutcomeNotFound
        | EventType::OutcomeAmbiguous
        | EventType::OutcomeResolved
        | EventType::TargetMoved
        | EventType::RunGated
        | EventType::RunCompensating
        | EventType::ProviderWaiting
        | EventType::ProviderReleased
        | EventType::ContextCompacted
        | EventType::RunQueued
        | EventType::SlotGranted => true,
        EventType::Nudge => false,
    }
}

/// An event as clients get it: the journal envelope plus its sequence (`seq`).
pub fn event_json(r: &Recorded) -> serde_json::Value {
    let mut v = serde_json::to_value(&r.envelope).unwrap_or(serde_json::Value::Null);
    if let Some(obj) = v.as_object_mut() {
        obj.insert("seq".into(), r.seq.into());
    }
    v
}

/// The SSE frame of an event: `id:` is the journal sequence, `event:` the type, `data:` one line
/// of JSON ([`event_json`]).
pub fn sse_frame(r: &Recorded) -> Bytes {
    let data = serde_json::to_string(&event_json(r)).unwrap_or_default();
    Bytes::from(format!(
        "id: {}\nevent: {}\ndata: {data}\n\n",
        r.seq,
        r.envelope.event_type()
    ))
}

/// The SSE frame of a token delta (core NATS `agent.delta.<run>`): no `id:`, so it never moves a
/// client's resume point. `None` for a payload that is not JSON.
pub fn delta_frame(payload: &[u8]) -> Option<Bytes> {
    let v: serde_json::Value = serde_json::from_slice(payload).ok()?;
    let data = serde_json::to_string(&v).ok()?;
    Some(Bytes::from(format!("event: delta\ndata: {data}\n\n")))
}

/// Whether the run has ended and nothing is about to revive it. An SSE stream ends after the
/// event that makes this true. Pure, so it lives in the core, where retention (in the runtime)
/// reads it too.
pub use kedge_core::decide::finished;

/// `GET /v1/runs/{id}`.
#[derive(Debug, Clone, Serialize)]
pub struct RunView {
    pub run_id: RunId,
    pub tenant: TenantId,
    pub agent: AgentName,
    pub agent_revision: u64,
    /// The run's lifecycle status (not the connection's, not the result's).
    pub status: RunStatus,
    /// True when the run ended and nothing is about to revive it.
    pub finished: bool,
    pub turn: u32,
    pub created_at: Timestamp,
    pub updated_at: Timestamp,
    /// The journal sequence this view was folded through.
    pub last_seq: u64,
    pub current_step: Option<CurrentStep>,
    pub waiting: Option<Waiting>,
    /// While the run waits on its model provider (`waiting_provider`): since when, on which
    /// endpoint, its last error and when the wait gives up. The next try is the fleet's to
    /// decide (`kedge providers` shows each endpoint's next probe).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<ProviderView>,
    /// While the run waits for a slot of its concurrency key (`run.queued`, docs/ARCHITECTURE.md
    /// "Concurrency keys and priorities"): the key, its limit, the run's priority and its place
    /// among the key's waiting runs when it began waiting (1 = next).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queued: Option<kedge_core::event::RunQueued>,
    pub usage: UsageView,
    pub budget: Budget,
    /// The business result of a succeeded run, with its own validation status.
    pub result: Option<ResultView>,
    pub failure: Option<RunFailed>,
    pub cancel_requested: Option<String>,
    /// Every operation with its level and fate and, once the run compensated (or while it
    /// does), what compensating it did (docs/ARCHITECTURE.md "Compensation"). Only for runs
    /// whose agent declares reversibility; absent otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub effects: Vec<kedge_core::event::OpSummary>,
    pub metadata: serde_json::Map<String, serde_json::Value>,
    pub links: Links,
}

#[derive(Debug, Clone, Serialize)]
pub struct ProviderView {
    pub endpoint: String,
    pub trouble: kedge_core::event::Trouble,
    pub since: Timestamp,
    pub last_error: String,
    pub give_up_at: Timestamp,
}

#[derive(Debug, Clone, Serialize)]
pub struct CurrentStep {
    /// The last step started (steps are numbered from 1 per run).
    pub number: u32,
    /// The attempt in progress, when the step's model call has not completed.
    pub attempt: Option<u32>,
    pub in_progress: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct Waiting {
    pub on: WaitReason,
    pub questions: Vec<QuestionView>,
    pub operations: Vec<OperationView>,
    pub approvals: Vec<ApprovalView>,
    pub timers: Vec<TimerView>,
    /// Child runs (and their children) that wait on a person: a question to answer or an
    /// approval to give, on the child's run id ([`add_children`]). Absent when none does.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub children: Vec<ChildWaiting>,
}

/// A child run below this one that waits on a person.
#[derive(Debug, Clone, Serialize)]
pub struct ChildWaiting {
    pub run_id: RunId,
    pub agent: AgentName,
    /// The `run_agent` operation (of the run right above it) that started it.
    pub op: OperationId,
    pub on: WaitReason,
    pub questions: Vec<QuestionView>,
    pub approvals: Vec<ApprovalView>,
}

#[derive(Debug, Clone, Serialize)]
pub struct QuestionView {
    pub question_id: kedge_core::ids::QuestionId,
    pub prompt: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct OperationView {
    pub op: OperationId,
    pub tool: String,
    /// `awaiting_approval`, `requested`, `started`, or `ambiguous` (a person must resolve it).
    pub status: &'static str,
}

#[derive(Debug, Clone, Serialize)]
pub struct ApprovalView {
    pub approval_id: kedge_core::ids::ApprovalId,
    pub tool: String,
    pub expires_at: Timestamp,
}

#[derive(Debug, Clone, Serialize)]
pub struct TimerView {
    pub timer_id: kedge_core::ids::TimerId,
    pub fire_at: Timestamp,
}

#[derive(Debug, Clone, Serialize)]
pub struct UsageView {
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub total_tokens: u64,
    /// What the run cost so far, when its model has a price (`model.price`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cost: Option<f64>,
    /// The price's currency (and `budget.max_cost`'s).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub currency: Option<String>,
}

impl From<Usage> for UsageView {
    fn from(u: Usage) -> Self {
        Self {
            input_tokens: u.input_tokens,
            output_tokens: u.output_tokens,
            total_tokens: u.total(),
            cost: u.cost,
            currency: None,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct ResultView {
    pub output: String,
    /// Whether the output passed validation; independent of the run's status.
    pub validation: OutputValidation,
}

#[derive(Debug, Clone, Serialize)]
pub struct Links {
    #[serde(rename = "self")]
    pub this: String,
    pub events: String,
    pub history: String,
    pub messages: String,
    pub cancel: String,
}

impl Links {
    pub fn for_run(run: &RunId) -> Self {
        let base = format!("/v1/runs/{run}");
        Self {
            events: format!("{base}/events"),
            history: format!("{base}/history"),
            messages: format!("{base}/messages"),
            cancel: format!("{base}/cancel"),
            this: base,
        }
    }
}

/// The validation status of the current turn's `run.succeeded`, if the run succeeded.
pub fn result_validation(events: &[Recorded]) -> Option<OutputValidation> {
    for r in events.iter().rev() {
        match &r.envelope.event {
            Event::RunSucceeded(s) => return Some(s.validation.clone()),
            Event::RunRevived(_) => return None,
            _ => {}
        }
    }
    None
}

/// Builds the view from the run's whole journal (`events`, non-empty) and its fold.
pub fn run_view(state: &RunState, events: &[Recorded]) -> RunView {
    let created_at = events
        .first()
        .map(|r| r.envelope.at)
        .unwrap_or_else(Timestamp::now);
    let updated_at = events.last().map(|r| r.envelope.at).unwrap_or(created_at);
    let current_step = (state.step.get() > 0).then(|| CurrentStep {
        number: state.step.get(),
        attempt: state.open_step.as_ref().map(|o| o.attempt.get()),
        in_progress: state.open_step.is_some(),
    });
    let waiting = state.waiting_on().map(|on| Waiting {
        on,
        questions: state
            .questions
            .iter()
            .filter(|(_, q)| q.answer.is_none())
            .map(|(id, q)| QuestionView {
                question_id: id.clone(),
                prompt: q.prompt.clone(),
            })
            .collect(),
        operations: state
            .unresolved_ops()
            .map(|o| OperationView {
                op: o.op.clone(),
                tool: o.call.name.clone(),
                status: match o.status {
                    OpStatus::AwaitingApproval => "awaiting_approval",
                    OpStatus::Requested | OpStatus::ToRetry => "requested",
                    OpStatus::Started { .. } => "started",
                    OpStatus::Ambiguous { .. } => "ambiguous",
                    OpStatus::Done => "done",
                },
            })
            .collect(),
        approvals: state
            .approvals
            .iter()
            .filter(|(_, a)| a.status == ApprovalStatus::Open)
            .map(|(id, a)| ApprovalView {
                approval_id: id.clone(),
                tool: a.request.tool.clone(),
                expires_at: a.request.expires_at,
            })
            .collect(),
        timers: state
            .timers
            .iter()
            .filter(|(_, t)| !t.fired)
            .map(|(id, t)| TimerView {
                timer_id: id.clone(),
                fire_at: t.fire_at,
            })
            .collect(),
        children: Vec::new(),
    });
    let provider = state
        .provider
        .as_ref()
        .filter(|_| state.status == RunStatus::WaitingProvider)
        .map(|w| ProviderView {
            endpoint: w.endpoint.clone(),
            trouble: w.trouble,
            since: w.since,
            last_error: w.message.clone(),
            give_up_at: w.give_up_at,
        });
    let result = match (&state.output, state.status) {
        (Some(output), RunStatus::Succeeded) => Some(ResultView {
            output: output.clone(),
            validation: result_validation(events).unwrap_or_default(),
        }),
        _ => None,
    };
    RunView {
        run_id: state.run_id.clone(),
        tenant: state.bundle.tenant.clone(),
        agent: state.bundle.agent.clone(),
        agent_revision: state.bundle.agent_revision,
        status: state.status,
        finished: finished(state),
        turn: state.turn,
        created_at,
        updated_at,
        last_seq: state.last_seq,
        current_step,
        waiting,
        provider,
        queued: state.queued.clone(),
        usage: UsageView {
            currency: state.bundle.model.currency().map(str::to_owned),
            ..state.usage.into()
        },
        budget: state.bundle.budget.clone(),
        result,
        failure: state.failure.clone(),
        cancel_requested: state.cancel_requested.clone(),
        effects: if state.declares_levels() || state.compensation.is_some() {
            state.op_summaries()
        } else {
            Vec::new()
        },
        metadata: state.bundle.metadata.clone(),
        links: Links::for_run(&state.run_id),
    }
}

/// The open questions of a run.
fn open_questions(state: &RunState) -> Vec<QuestionView> {
    state
        .questions
        .iter()
        .filter(|(_, q)| q.is_open())
        .map(|(id, q)| QuestionView {
            question_id: id.clone(),
            prompt: q.prompt.clone(),
        })
        .collect()
}

/// The open approval requests of a run.
fn open_approvals(state: &RunState) -> Vec<ApprovalView> {
    state
        .approvals
        .iter()
        .filter(|(_, a)| a.status == ApprovalStatus::Open)
        .map(|(id, a)| ApprovalView {
            approval_id: id.clone(),
            tool: a.request.tool.clone(),
            expires_at: a.request.expires_at,
        })
        .collect()
}

/// The child runs below `state` (children, their children, …, at most
/// [`kedge_core::child::MAX_DEPTH`] levels) whose result is still missing and that wait on a
/// person. One journal read per open child; a child that cannot be read is left out (the view
/// is a report, not a decision).
pub async fn children_waiting(
    journal: &kedge_journal::Journal,
    state: &RunState,
) -> Vec<ChildWaiting> {
    let open = |s: &RunState| -> Vec<(OperationId, RunId)> {
        s.children
            .iter()
            .filter(|(op, _)| s.ops.get(*op).is_some_and(|o| o.result.is_none()))
            .map(|(op, id)| (op.clone(), id.clone()))
            .collect()
    };
    let mut out = Vec::new();
    let mut level = open(state);
    for _ in 0..kedge_core::child::MAX_DEPTH {
        let mut next = Vec::new();
        for (op, id) in level {
            let events = match journal.read(&id, 0).await {
                Ok(events) if !events.is_empty() => events,
                Ok(_) => continue,
                Err(e) => {
                    tracing::debug!(child = %id, error = %e, "cannot read a child run for the view");
                    continue;
                }
            };
            let Ok(child) = kedge_core::fold(events.iter().map(|r| (r.seq, &r.envelope))) else {
                continue;
            };
            // Only the operation's own child, in the same tenant: a run that took a child's id
            // (a task naming it) shows nothing of itself here.
            let linked = child
                .bundle
                .parent
                .as_ref()
                .is_some_and(|link| link.op == op && link.run_id == *op.run());
            if !linked || child.bundle.tenant != state.bundle.tenant {
                continue;
            }
            if let Some(on @ (WaitReason::User | WaitReason::Approval)) = child.waiting_on() {
                out.push(ChildWaiting {
                    run_id: id.clone(),
                    agent: child.bundle.agent.clone(),
                    op,
                    on,
                    questions: open_questions(&child),
                    approvals: open_approvals(&child),
                });
            }
            next.extend(open(&child));
        }
        if next.is_empty() {
            break;
        }
        level = next;
    }
    out
}

/// Fills `view.waiting.children` ([`children_waiting`]) for a run that waits.
pub async fn add_children(journal: &kedge_journal::Journal, state: &RunState, view: &mut RunView) {
    if let Some(waiting) = &mut view.waiting
        && !state.children.is_empty()
    {
        waiting.children = children_waiting(journal, state).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_nudges_are_private() {
        let private: Vec<_> = EventType::ALL.iter().filter(|t| !is_public(**t)).collect();
        assert_eq!(private, vec![&EventType::Nudge]);
    }

    #[test]
    fn delta_frames_carry_no_id_and_one_data_line() {
        let f = delta_frame(br#"{"step": 1, "text": "a\nb"}"#).expect("json");
        let s = std::str::from_utf8(&f).expect("utf8");
        assert!(s.starts_with("event: delta\ndata: {"));
        assert!(!s.contains("id:"));
        assert_eq!(s.matches('\n').count(), 3, "{s:?}");
        assert!(delta_frame(b"not json").is_none());
    }
}
