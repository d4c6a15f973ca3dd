//! The operations a decision waits on or acts on: ambiguous ones (a person decides), ones
//! found not to have happened (dispatched again), running ones (a cancel waits for them).

use crate::event::{Decision, Draft, RunUnknown, ToolRequested};
use crate::fold::{OpStatus, RunState};

use super::Next;
use super::approvals::approved_version;

pub(super) fn has_ambiguous(state: &RunState) -> bool {
    state
        .ops
        .values()
        .any(|o| matches!(o.status, OpStatus::Ambiguous { .. }))
}

pub(super) fn unknown(state: &RunState) -> Next {
    Next::Commit(vec![Draft::new(Decision::RunUnknown(RunUnknown {
        reason: ambiguous_reason(state),
    }))])
}

fn ambiguous_reason(state: &RunState) -> String {
    let ops: Vec<String> = state
        .ops
        .values()
        .filter_map(|o| match &o.status {
            OpStatus::Ambiguous { detail } => Some(format!("{}: {detail}", o.op)),
            OpStatus::AwaitingApproval
            | OpStatus::Requested
            | OpStatus::Started { .. }
            | OpStatus::ToRetry
            | OpStatus::Done => None,
        })
        .collect();
    format!(
        "the outcome of {} is unknown; a person must resolve it",
        ops.join("; ")
    )
}

/// `tool.requested` again, same operation and arguments, for every operation found not to have
/// happened.
pub(super) fn redispatches(state: &RunState) -> Vec<Draft<Decision>> {
    state
        .ops
        .values()
        .filter(|o| o.status == OpStatus::ToRetry)
        .map(|o| {
            Draft::new(Decision::ToolRequested(ToolRequested {
                call_id: o.call.call_id.clone(),
                tool: o.call.name.clone(),
                arguments: o.call.arguments.clone(),
                args_digest: o.args_digest.clone(),
                redispatch: o.dispatches,
                expect_version: approved_version(state, &o.op),
                limits: o.limits.clone(),
                reversibility: o.reversibility.clone(),
                compensates: o.compensates.clone(),
            }))
            .step(o.op.step())
            .op(o.op.clone())
        })
        .collect()
}

/// Operations whose outcome a cancel waits for: those a runner started, and child runs that
/// have not given their result (the step service asks each to cancel, and it answers when it
/// has).
pub(super) fn running_ops(state: &RunState) -> usize {
    state
        .ops
        .values()
        .filter(|o| {
            matches!(o.status, OpStatus::Started { .. })
                || (o.result.is_none() && state.children.contains_key(&o.op))
        })
        .count()
}
