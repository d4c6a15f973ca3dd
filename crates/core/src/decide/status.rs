//! What a live run calls for in each status: the arms of `decide_base`, and the decisions that
//! end a run.

use crate::event::{
    Budget, Decision, Draft, FailureReason, RunCancelled, RunCancelling, RunFailed, RunResumed,
    RunRevived, RunWaiting, TimerPurpose, WaitReason,
};
use crate::fold::{OpStatus, RunState};
use crate::ids::{OperationId, TimerId};
use crate::machine::RunStatus;

use super::approvals::act_on_approvals;
use super::operations::{has_ambiguous, redispatches, running_ops};
use super::step::{new_step, plan};
use super::{Idle, Next};

/// A finished run (`succeeded`, `failed`): a message since revives it into a new turn.
pub(super) fn revive(state: &RunState, budget: &Budget) -> Next {
    if state.pending_messages.is_empty() {
        return Next::Idle(Idle::Terminal);
    }
    let revive = Draft::new(Decision::RunRevived(RunRevived {
        turn: state.turn.saturating_add(1),
    }));
    new_step(state, budget, vec![revive])
}

/// An `unknown` run: it waits until a person resolved every ambiguous operation.
pub(super) fn after_resolution(state: &RunState) -> Next {
    if has_ambiguous(state) {
        Next::Idle(Idle::Unknown)
    } else if state.cancel_requested.is_some() {
        Next::Commit(vec![cancelled(state)])
    } else {
        // A person resolved every ambiguous operation: resume (and re-dispatch those
        // they chose to retry) in one group.
        let mut drafts = vec![Draft::new(Decision::RunResumed(RunResumed {}))];
        drafts.extend(redispatches(state));
        if drafts.len() > 1 {
            drafts.push(Draft::new(Decision::RunWaiting(RunWaiting {
                on: WaitReason::Tool,
            })));
        }
        Next::Commit(drafts)
    }
}

/// A live run a cancel was requested for: it is cancelling, and cancelled at once when no
/// operation is running or ambiguous.
pub(super) fn start_cancel(state: &RunState) -> Next {
    let reason = state.cancel_requested.clone().unwrap_or_default();
    let mut drafts = vec![Draft::new(Decision::RunCancelling(RunCancelling {
        reason,
    }))];
    if running_ops(state) == 0 && !has_ambiguous(state) {
        drafts.push(cancelled(state));
    }
    Next::Commit(drafts)
}

/// A run waiting on its model provider: the step's next attempt once the fleet released it, a
/// failure once the wait's bound passed (docs/ARCHITECTURE.md "Provider trouble").
pub(super) fn after_provider_wait(state: &RunState, budget: &Budget) -> Next {
    match (&state.open_step, &state.provider) {
        (Some(open), Some(wait)) => {
            let timer = TimerId::for_provider_wait(&state.run_id, open.step);
            if state.timers.get(&timer).is_some_and(|t| t.fired) {
                return fail(
                    FailureReason::ProviderUnavailable,
                    format!(
                        "step {}: the model provider ({}) was {} from {} to {}; its last error: {}",
                        open.step,
                        wait.endpoint,
                        wait.trouble,
                        wait.since,
                        wait.give_up_at,
                        wait.message
                    ),
                );
            }
            match wait.released {
                Some(probe) => {
                    let mut p = plan(state, open.step, open.attempt.next(), None, vec![]);
                    p.released = Some(probe);
                    Next::Step(Box::new(p))
                }
                None => Next::Idle(Idle::WaitingProvider),
            }
        }
        // Not what the writer journals (the fold keeps both from `provider.waiting`):
        // the step goes on as a running one would.
        _ => match &state.open_step {
            Some(open) => Next::Step(Box::new(plan(
                state,
                open.step,
                open.attempt.next(),
                None,
                vec![],
            ))),
            None => new_step(state, budget, vec![]),
        },
    }
}

/// A running run: the open step's next attempt, or the next step.
pub(super) fn running(state: &RunState, budget: &Budget) -> Next {
    match &state.open_step {
        Some(open) => {
            // Attempts that met provider trouble, or were held, spend nothing.
            if open.spent() >= budget.max_attempts_per_step {
                return fail(
                    FailureReason::AttemptsExhausted,
                    format!(
                        "step {} failed {} attempts",
                        open.step, budget.max_attempts_per_step
                    ),
                );
            }
            let attempt = open.attempt.next();
            let unfinished =
                (!open.failed).then(|| (open.request_id.clone(), open.context_digest.clone()));
            Next::Step(Box::new(plan(
                state,
                open.step,
                attempt,
                unfinished,
                vec![],
            )))
        }
        None => {
            let missing = state
                .last_step_ops()
                .iter()
                .filter(|o| o.result.is_none())
                .count();
            if missing > 0 {
                // Resumed with operations still out: wait for them.
                Next::Commit(vec![Draft::new(Decision::RunWaiting(RunWaiting {
                    on: WaitReason::Tool,
                }))])
            } else {
                new_step(state, budget, vec![])
            }
        }
    }
}

/// A waiting run: what its approvals call for, else the next step once the last step's
/// operations all have their results, else nothing.
pub(super) fn waiting(state: &RunState, budget: &Budget) -> Next {
    let mut acts = act_on_approvals(state);
    if !acts.is_empty() {
        let settled: Vec<&OperationId> = acts
            .iter()
            .filter(|d| {
                matches!(
                    d.event,
                    Decision::ToolRequested(_) | Decision::ApprovalExpired(_)
                )
            })
            .filter_map(|d| d.op.as_ref())
            .collect();
        let still_held = state.ops.values().any(|o| {
            o.status == OpStatus::AwaitingApproval
                && o.result.is_none()
                && !settled.contains(&&o.op)
        });
        if !still_held && state.status == RunStatus::WaitingApproval {
            acts.push(Draft::new(Decision::RunWaiting(RunWaiting {
                on: WaitReason::Tool,
            })));
        }
        // An operation back in a person's hands (its target moved before it ran).
        if still_held && state.status == RunStatus::WaitingTool {
            acts.push(Draft::new(Decision::RunWaiting(RunWaiting {
                on: WaitReason::Approval,
            })));
        }
        return Next::Commit(acts);
    }
    let missing = state
        .last_step_ops()
        .iter()
        .filter(|o| o.result.is_none())
        .count();
    if missing == 0 {
        return new_step(state, budget, vec![]);
    }
    Next::Idle(match state.status {
        RunStatus::WaitingUser => Idle::WaitingUser,
        RunStatus::WaitingApproval => Idle::WaitingApproval,
        RunStatus::WaitingExternal => Idle::WaitingExternal,
        RunStatus::WaitingTool
        | RunStatus::Queued
        | RunStatus::Running
        | RunStatus::WaitingProvider
        | RunStatus::Cancelling
        | RunStatus::Compensating
        | RunStatus::Unknown
        | RunStatus::Succeeded
        | RunStatus::Failed
        | RunStatus::Cancelled => Idle::WaitingTools { missing },
    })
}

/// The run-deadline timer fired.
pub(super) fn deadline_passed(state: &RunState) -> bool {
    state
        .timers
        .values()
        .any(|t| t.fired && t.purpose == TimerPurpose::RunDeadline)
}

pub(super) fn cancelled(state: &RunState) -> Draft<Decision> {
    Draft::new(Decision::RunCancelled(RunCancelled {
        operations: state.op_summaries(),
    }))
}

pub(super) fn finish_cancel(state: &RunState) -> Next {
    let running = running_ops(state);
    if running > 0 {
        return Next::Idle(Idle::Stopping { running });
    }
    Next::Commit(vec![cancelled(state)])
}

pub(super) fn fail(reason: FailureReason, message: String) -> Next {
    Next::Commit(vec![Draft::new(Decision::RunFailed(RunFailed {
        reason,
        message,
        effects: Vec::new(),
    }))])
}
