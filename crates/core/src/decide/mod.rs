//! `decide(state) -> Next`: what the decision writer should do next, as pure functions.
//!
//! The step service loops: fold the journal, [`decide`], carry out the answer (commit decisions, or
//! call the model and then commit [`complete_step`]'s decisions), fold again, until [`Next::Idle`].
//! Duplicate and early wakes land on `Idle`: the model is never called while a tool result is
//! missing (docs/ARCHITECTURE.md, "The step service").
//!
//! Split by role:
//! - this module: what to do next ([`Next`]) and [`decide`], which asks the status's helper in
//!   `status` (a run's end, a cancel, a wait, the next attempt);
//! - `step`: starting a step (the budget's checks, the model call's plan);
//! - `complete`: the decisions that complete a step with the model's answer ([`complete_step`],
//!   [`finish_step`], [`final_answer`]);
//! - `approvals`: requests for a person's approval and what their decisions call for;
//! - `operations`: operations found not to have happened, ambiguous or still running;
//! - `provider`: model-call retries and waits on the model provider ([`wait_on_provider`]).

mod approvals;
mod complete;
mod operations;
mod provider;
mod status;
mod step;

pub use complete::{
    DEFAULT_CALLBACK_SECS, MAX_WAIT_SECS, complete_step, complete_step_gated, final_answer,
    finish_step,
};
pub use provider::{MODEL_BACKOFF, TroubleMet, model_retry_delay, wait_on_provider};

use crate::event::{
    AssistantMessage, Decision, Digest, Draft, FailureReason, FinishReason, RunStarted, Usage,
};
use crate::fold::{ChatMessage, OpStatus, RunState};
use crate::ids::{Attempt, ModelRequestId, StepNo};
use crate::machine::RunStatus;
use crate::tools::Contract;

use operations::{has_ambiguous, redispatches, unknown};
use step::new_step;

/// Why there is nothing to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Idle {
    Terminal,
    /// Tool results still missing.
    WaitingTools {
        missing: usize,
    },
    WaitingUser,
    WaitingApproval,
    WaitingExternal,
    /// Cancelling: operations still running.
    Stopping {
        running: usize,
    },
    /// An ambiguous operation waits for a person.
    Unknown,
    /// The model provider is in trouble: the fleet releases the run when it may call again.
    WaitingProvider,
    /// The run's concurrency key is at its limit: a `slot.granted` wakes it (docs/ARCHITECTURE.md
    /// "Concurrency keys and priorities"). Said by the writer, which asks the key's record;
    /// `decide` itself never answers it.
    Queued,
}

/// A model call to make.
#[derive(Debug, Clone, PartialEq)]
pub struct StepPlan {
    pub step: StepNo,
    pub attempt: Attempt,
    pub request_id: ModelRequestId,
    /// An earlier attempt of this step that was journaled and never completed or failed: a worker
    /// that died after the model answered may have stored the response under this id. The shell
    /// looks there first and, when found with the same context digest, commits
    /// [`complete_step`] with `reused = true` instead of calling the model.
    pub unfinished: Option<(ModelRequestId, Digest)>,
    pub context: Vec<ChatMessage>,
    pub context_digest: Digest,
    /// Decisions to journal (as one group) before calling the model.
    pub start: Vec<Draft<Decision>>,
    /// The fleet released this attempt from a wait on the provider (`Some(probe)`): it may
    /// call an endpoint whose breaker holds the runs that were not released.
    pub released: Option<bool>,
}

impl StepPlan {
    /// Gives each tool call that `contract` refuses its refusal as an error result, in the
    /// context, right after the assistant turn that made it (unless the context already holds a
    /// result for it); the context digest, and `step.started`'s, follow. [`complete_step`] did
    /// not dispatch such a call, so nothing else answers it. The verdict is a pure function of
    /// the journaled call and the run's frozen revision, so every attempt, worker and replay
    /// builds the same context.
    pub fn answer_refused(&mut self, contract: &Contract) {
        // The refusals to insert, each with the position of the turn it follows (the context is
        // copied only when there is one: most steps have none).
        let mut refusals: Vec<(usize, ChatMessage)> = Vec::new();
        for (i, message) in self.context.iter().enumerate() {
            let ChatMessage::Assistant { message: turn } = message else {
                continue;
            };
            if turn.tool_calls.is_empty() {
                continue;
            }
            // The results of this turn: the tool messages up to the next assistant turn.
            let answered: Vec<&str> = self.context[i + 1..]
                .iter()
                .take_while(|m| !matches!(m, ChatMessage::Assistant { .. }))
                .filter_map(|m| match m {
                    ChatMessage::Tool { call_id, .. } => Some(call_id.as_str()),
                    ChatMessage::User { .. } | ChatMessage::Assistant { .. } => None,
                })
                .collect();
            for call in &turn.tool_calls {
                if answered.contains(&call.call_id.as_str()) {
                    continue;
                }
                if let Err(refusal) = contract.check(call) {
                    refusals.push((
                        i,
                        ChatMessage::Tool {
                            call_id: call.call_id.clone(),
                            content: refusal.to_string(),
                            is_error: true,
                        },
                    ));
                }
            }
        }
        if refusals.is_empty() {
            return;
        }
        let mut out = Vec::with_capacity(self.context.len() + refusals.len());
        let mut refusals = refusals.into_iter().peekable();
        for (i, message) in std::mem::take(&mut self.context).into_iter().enumerate() {
            out.push(message);
            while let Some((_, refusal)) = refusals.next_if(|(at, _)| *at == i) {
                out.push(refusal);
            }
        }
        self.context = out;
        self.context_digest = Digest::of(&self.context);
        for draft in &mut self.start {
            if let Decision::StepStarted(started) = &mut draft.event {
                started.context_digest = self.context_digest.clone();
            }
        }
    }
}

/// What to do next.
#[derive(Debug, Clone, PartialEq)]
pub enum Next {
    Idle(Idle),
    /// Journal these decisions (one group), then decide again.
    Commit(Vec<Draft<Decision>>),
    /// Journal `plan.start`, call the model, then journal [`complete_step`].
    Step(Box<StepPlan>),
    /// A step's decision group was cut short (its writer died between appends): journal the
    /// rest of it, [`finish_step`], then decide again.
    Finish(Box<crate::fold::Completing>),
}

/// The model's answer, provider-neutral.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ModelResponse {
    pub message: AssistantMessage,
    pub usage: Usage,
    pub finish: FinishReason,
}

/// Decides the next action for a run. A run that ends (cancelled, failed) with effects its
/// agent compensates goes through `compensating` first ([`crate::compensation`]).
pub fn decide(state: &RunState) -> Next {
    if state.status == RunStatus::Compensating && state.completing.is_none() {
        return crate::compensation::next(state);
    }
    match decide_base(state) {
        Next::Commit(drafts) => Next::Commit(crate::compensation::intercept(state, drafts)),
        other => other,
    }
}

/// Whether the run has ended and nothing is about to revive it: a terminal status with no user
/// message waiting to start a new turn (the step service's own rule, [`decide`]). What clients
/// are shown as `finished` (docs/API.md "SSE: `GET /v1/runs/{id}/events`": a stream ends after
/// the event that makes this true) and the only runs retention purges (docs/RUNBOOK.md
/// "Retention (purging finished runs)").
pub fn finished(state: &RunState) -> bool {
    state.status.is_terminal() && matches!(decide(state), Next::Idle(Idle::Terminal))
}

fn decide_base(state: &RunState) -> Next {
    let budget = &state.bundle.budget;
    // A cut-short decision group is finished before anything else (a group always ends by
    // settling the status, so a terminal run never has one).
    if let Some(c) = &state.completing {
        return Next::Finish(Box::new(c.clone()));
    }
    match state.status {
        RunStatus::Cancelled => Next::Idle(Idle::Terminal),
        RunStatus::Succeeded | RunStatus::Failed => status::revive(state, budget),
        RunStatus::Unknown => status::after_resolution(state),
        RunStatus::Compensating => crate::compensation::next(state),
        RunStatus::Cancelling if has_ambiguous(state) => unknown(state),
        RunStatus::Cancelling => status::finish_cancel(state),
        _ if state.cancel_requested.is_some() => status::start_cancel(state),
        _ if has_ambiguous(state) => unknown(state),
        _ if state.ops.values().any(|o| o.status == OpStatus::ToRetry)
            && state.open_step.is_none()
            && state.status != RunStatus::Queued =>
        {
            Next::Commit(redispatches(state))
        }
        _ if status::deadline_passed(state) => status::fail(
            FailureReason::Deadline,
            format!(
                "the run's deadline of {} s passed",
                budget.deadline_secs.unwrap_or_default()
            ),
        ),
        RunStatus::Queued => new_step(
            state,
            budget,
            vec![Draft::new(Decision::RunStarted(RunStarted {}))],
        ),
        RunStatus::WaitingProvider => status::after_provider_wait(state, budget),
        RunStatus::Running => status::running(state, budget),
        RunStatus::WaitingTool
        | RunStatus::WaitingUser
        | RunStatus::WaitingApproval
        | RunStatus::WaitingExternal => status::waiting(state, budget),
    }
}
