//! Requests for a person's approval, and what their decisions call for: the operation
//! dispatched, the request expired, or invalidated and asked again.

use crate::event::{
    ApprovalExpired, ApprovalInvalidated, ApprovalRequested, Decision, Digest, Draft, TimerPurpose,
    TimerScheduled, Timestamp, ToolRequested, Verdict,
};
use crate::fold::{ApprovalState, ApprovalStatus, OpStatus, RunState, ToolOp};
use crate::ids::{ApprovalId, OperationId, TimerId};

/// What an approval request carries from the policy that held its operation back.
pub(super) struct Held {
    pub(super) risk: crate::event::Risk,
    pub(super) basis: String,
    pub(super) limits: crate::tools::RunLimits,
    pub(super) reversibility: Option<crate::event::Reversibility>,
}

/// `approval.requested` (version `version`) and its expiry timer.
pub(super) fn approval_request(
    op: &OperationId,
    call: &crate::event::ToolCall,
    args_digest: Digest,
    held: Held,
    version: u32,
    expires_at: Timestamp,
) -> [Draft<Decision>; 2] {
    let approval_id = ApprovalId::for_operation(op, version);
    [
        Draft::new(Decision::ApprovalRequested(ApprovalRequested {
            approval_id: approval_id.clone(),
            tool: call.name.clone(),
            call_id: call.call_id.clone(),
            arguments: call.arguments.clone(),
            args_digest,
            risk: held.risk,
            basis: held.basis,
            expires_at,
            plan_version: version,
            // Observed by the step service before it commits (a tool runner's precondition
            // check): the pure core cannot look at the target.
            target_version: None,
            limits: held.limits.clone(),
            reversibility: held.reversibility,
        }))
        .step(op.step())
        .op(op.clone()),
        Draft::new(Decision::TimerScheduled(TimerScheduled {
            timer_id: TimerId::for_approval(&approval_id),
            fire_at: expires_at,
            purpose: TimerPurpose::ApprovalExpiry { approval_id },
        }))
        .step(op.step())
        .op(op.clone()),
    ]
}

/// A fresh request (next plan version) after `a` was invalidated at `from`: same policy, same
/// validity period, the operation's current arguments.
fn ask_again(a: &ApprovalState, tool: &ToolOp, from: Timestamp) -> [Draft<Decision>; 2] {
    let ttl = a.request.expires_at.0 - a.requested_at.0;
    approval_request(
        &tool.op,
        &tool.call,
        tool.args_digest.clone(),
        Held {
            risk: a.request.risk,
            basis: a.request.basis.clone(),
            limits: a.request.limits.clone(),
            reversibility: a.request.reversibility.clone(),
        },
        a.request.plan_version.saturating_add(1),
        from.saturating_add_signed(ttl),
    )
}

/// What the approvals of the run call for: dispatch what was validly approved, expire what ran
/// out of time, invalidate (and ask again) what was approved for other arguments than these.
/// Empty when there is nothing to do.
pub(super) fn act_on_approvals(state: &RunState) -> Vec<Draft<Decision>> {
    let mut drafts = Vec::new();
    for (id, a) in &state.approvals {
        let Some(op) = &a.op else { continue };
        let Some(tool) = state.ops.get(op) else {
            continue;
        };
        if tool.result.is_some() || tool.status != OpStatus::AwaitingApproval {
            continue;
        }
        act_on_approval(&mut drafts, state, id, a, op, tool);
    }
    ask_again_where_cut_short(&mut drafts, state);
    drafts
}

/// What approval `id` (`a`) of operation `op` (`tool`), still held back, calls for.
fn act_on_approval(
    drafts: &mut Vec<Draft<Decision>>,
    state: &RunState,
    id: &ApprovalId,
    a: &ApprovalState,
    op: &OperationId,
    tool: &ToolOp,
) {
    let expire = || {
        Draft::new(Decision::ApprovalExpired(ApprovalExpired {
            approval_id: id.clone(),
        }))
        .step(op.step())
        .op(op.clone())
    };
    match &a.status {
        ApprovalStatus::Open => {
            let timer_fired = state
                .timers
                .get(&TimerId::for_approval(id))
                .is_some_and(|t| t.fired);
            if timer_fired {
                drafts.push(expire());
            }
        }
        ApprovalStatus::Decided {
            verdict: Verdict::Approve,
            args_digest,
            at,
            ..
        } => {
            if let Some(moved) = &tool.target_moved {
                // The runner found the target changed since it was shown: what was approved
                // is not what would be changed. Ask again, showing where it is now.
                drafts.push(
                    Draft::new(Decision::ApprovalInvalidated(ApprovalInvalidated {
                        approval_id: id.clone(),
                        reason: format!(
                            "the target moved since it was shown: approved at version {}, now {}",
                            moved.expected, moved.found
                        ),
                    }))
                    .step(op.step())
                    .op(op.clone()),
                );
                drafts.extend(ask_again(a, tool, tool.since));
            } else if *at > a.request.expires_at {
                drafts.push(expire());
            } else if *args_digest != tool.args_digest {
                // The approver saw other arguments than the ones that would run.
                drafts.push(
                    Draft::new(Decision::ApprovalInvalidated(ApprovalInvalidated {
                        approval_id: id.clone(),
                        reason: format!(
                            "approved arguments {args_digest} differ from the operation's {}",
                            tool.args_digest
                        ),
                    }))
                    .step(op.step())
                    .op(op.clone()),
                );
                drafts.extend(ask_again(a, tool, *at));
            } else {
                drafts.push(
                    Draft::new(Decision::ToolRequested(ToolRequested {
                        call_id: tool.call.call_id.clone(),
                        tool: tool.call.name.clone(),
                        arguments: tool.call.arguments.clone(),
                        args_digest: tool.args_digest.clone(),
                        // 0 the first time; after its target moved, the next dispatch.
                        redispatch: tool.dispatches,
                        expect_version: a.request.target_version.clone(),
                        limits: tool.limits.clone(),
                        reversibility: tool.reversibility.clone(),
                        compensates: None,
                    }))
                    .step(op.step())
                    .op(op.clone()),
                );
            }
        }
        // A denial already gave the operation its result; invalidated and expired
        // requests are settled.
        ApprovalStatus::Decided {
            verdict: Verdict::Deny,
            ..
        }
        | ApprovalStatus::Invalidated { .. }
        | ApprovalStatus::Expired => {}
    }
}

/// An invalidation whose fresh request was cut short (the writer died between the appends)
/// leaves an operation held with no request open: ask again.
fn ask_again_where_cut_short(drafts: &mut Vec<Draft<Decision>>, state: &RunState) {
    for tool in state.ops.values() {
        if tool.status != OpStatus::AwaitingApproval || tool.result.is_some() {
            continue;
        }
        let latest = state
            .approvals
            .values()
            .filter(|a| a.op.as_ref() == Some(&tool.op))
            .max_by_key(|a| a.request.plan_version);
        if let Some(a) = latest
            && let ApprovalStatus::Invalidated { at } = a.status
            && !drafts.iter().any(|d| d.op.as_ref() == Some(&tool.op))
        {
            drafts.extend(ask_again(a, tool, at));
        }
    }
}

/// The target version of the approval an operation runs under, if any.
pub(super) fn approved_version(state: &RunState, op: &OperationId) -> Option<String> {
    state
        .approvals
        .values()
        .filter(|a| {
            a.op.as_ref() == Some(op)
                && matches!(
                    a.status,
                    ApprovalStatus::Decided {
                        verdict: Verdict::Approve,
                        ..
                    }
                )
        })
        .max_by_key(|a| a.request.plan_version)
        .and_then(|a| a.request.target_version.clone())
}
