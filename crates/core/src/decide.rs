//! `decide(state) -> Next`: what the decision writer should do next, as pure functions.
//!
//! The step service loops: fold the journal, [`decide`], carry out the answer (commit decisions, or
//! call the model and then commit [`complete_step`]'s decisions), fold again, until [`Next::Idle`].
//! Duplicate and early wakes land on `Idle`: the model is never called while a tool result is
//! missing (docs/ARCHITECTURE.md, "The step service").

use crate::agent::{DEFAULT_APPROVAL_TTL_SECS, OnInvalidOutput};
use crate::event::{
    ApprovalExpired, ApprovalInvalidated, ApprovalRequested, CallbackExpected, ChildStarted,
    Verdict,
};
use crate::event::{
    AssistantMessage, Budget, Digest, Draft, Event, FailureReason, FinishReason, QuestionAsked,
    RunCancelled, RunCancelling, RunFailed, RunResumed, RunRevived, RunStarted, RunSucceeded,
    RunUnknown, RunWaiting, StepCompleted, StepStarted, ToolRequested, Usage, WaitReason,
};
use crate::event::{
    Gate, OutputRejected, OutputValidation, RunGated, TimerPurpose, TimerScheduled, Timestamp,
};
use crate::fold::{ASK_USER_TOOL, AWAIT_CALLBACK_TOOL, ChatMessage, OpStatus, RunState, WAIT_TOOL};
use crate::fold::{ApprovalStatus, Gates};
use crate::ids::ApprovalId;
use crate::ids::{Attempt, CallbackKey, ModelRequestId, OperationId, QuestionId, StepNo, TimerId};
use crate::machine::RunStatus;
use crate::tools::Contract;

/// Longest `wait` (and callback timeout) a model may ask for (seven days); longer requests are
/// clamped.
pub const MAX_WAIT_SECS: u64 = 7 * 24 * 3600;
/// How long an `await_callback` waits when the call names no `timeout_seconds`.
pub const DEFAULT_CALLBACK_SECS: u64 = 24 * 3600;

/// A number of seconds from a tool call's arguments, clamped to `[0, MAX_WAIT_SECS]`.
fn seconds_arg(args: &serde_json::Value, name: &str, default: u64) -> std::time::Duration {
    let secs = args
        .get(name)
        .and_then(|s| s.as_f64())
        .unwrap_or(default as f64)
        .clamp(0.0, MAX_WAIT_SECS as f64);
    std::time::Duration::from_secs_f64(secs)
}

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
    pub start: Vec<Draft>,
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
            if let Event::StepStarted(started) = &mut draft.event {
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
    Commit(Vec<Draft>),
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

fn decide_base(state: &RunState) -> Next {
    let budget = &state.bundle.budget;
    // A cut-short decision group is finished before anything else (a group always ends by
    // settling the status, so a terminal run never has one).
    if let Some(c) = &state.completing {
        return Next::Finish(Box::new(c.clone()));
    }
    match state.status {
        RunStatus::Cancelled => Next::Idle(Idle::Terminal),
        RunStatus::Succeeded | RunStatus::Failed => {
            if state.pending_messages.is_empty() {
                return Next::Idle(Idle::Terminal);
            }
            let revive = Draft::new(Event::RunRevived(RunRevived {
                turn: state.turn.saturating_add(1),
            }));
            new_step(state, budget, vec![revive])
        }
        RunStatus::Unknown => {
            if has_ambiguous(state) {
                Next::Idle(Idle::Unknown)
            } else if state.cancel_requested.is_some() {
                Next::Commit(vec![cancelled(state)])
            } else {
                // A person resolved every ambiguous operation: resume (and re-dispatch those
                // they chose to retry) in one group.
                let mut drafts = vec![Draft::new(Event::RunResumed(RunResumed {}))];
                drafts.extend(redispatches(state));
                if drafts.len() > 1 {
                    drafts.push(Draft::new(Event::RunWaiting(RunWaiting {
                        on: WaitReason::Tool,
                    })));
                }
                Next::Commit(drafts)
            }
        }
        RunStatus::Compensating => crate::compensation::next(state),
        RunStatus::Cancelling if has_ambiguous(state) => unknown(state),
        RunStatus::Cancelling => finish_cancel(state),
        _ if state.cancel_requested.is_some() => {
            let reason = state.cancel_requested.clone().unwrap_or_default();
            let mut drafts = vec![Draft::new(Event::RunCancelling(RunCancelling { reason }))];
            if running_ops(state) == 0 && !has_ambiguous(state) {
                drafts.push(cancelled(state));
            }
            Next::Commit(drafts)
        }
        _ if has_ambiguous(state) => unknown(state),
        _ if state.ops.values().any(|o| o.status == OpStatus::ToRetry)
            && state.open_step.is_none()
            && state.status != RunStatus::Queued =>
        {
            Next::Commit(redispatches(state))
        }
        _ if deadline_passed(state) => fail(
            FailureReason::Deadline,
            format!(
                "the run's deadline of {} s passed",
                budget.deadline_secs.unwrap_or_default()
            ),
        ),
        RunStatus::Queued => new_step(
            state,
            budget,
            vec![Draft::new(Event::RunStarted(RunStarted {}))],
        ),
        RunStatus::WaitingProvider => match (&state.open_step, &state.provider) {
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
        },
        RunStatus::Running => match &state.open_step {
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
                    Next::Commit(vec![Draft::new(Event::RunWaiting(RunWaiting {
                        on: WaitReason::Tool,
                    }))])
                } else {
                    new_step(state, budget, vec![])
                }
            }
        },
        RunStatus::WaitingTool
        | RunStatus::WaitingUser
        | RunStatus::WaitingApproval
        | RunStatus::WaitingExternal => {
            let mut acts = act_on_approvals(state);
            if !acts.is_empty() {
                let settled: Vec<&OperationId> = acts
                    .iter()
                    .filter(|d| {
                        matches!(d.event, Event::ToolRequested(_) | Event::ApprovalExpired(_))
                    })
                    .filter_map(|d| d.op.as_ref())
                    .collect();
                let still_held = state.ops.values().any(|o| {
                    o.status == OpStatus::AwaitingApproval
                        && o.result.is_none()
                        && !settled.contains(&&o.op)
                });
                if !still_held && state.status == RunStatus::WaitingApproval {
                    acts.push(Draft::new(Event::RunWaiting(RunWaiting {
                        on: WaitReason::Tool,
                    })));
                }
                // An operation back in a person's hands (its target moved before it ran).
                if still_held && state.status == RunStatus::WaitingTool {
                    acts.push(Draft::new(Event::RunWaiting(RunWaiting {
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
                _ => Idle::WaitingTools { missing },
            })
        }
    }
}

/// The rest of a step's decision group that a writer left cut short: the group as
/// [`complete_step`] makes it (without regard to a cancel requested since, which the next
/// decision handles), minus `step.completed` and the decisions that already landed. The group
/// keeps the branch its writer took: decided with the gates marked before it, and taking
/// anew the gates its landed part took (a marker that landed, or for
/// [`Gate::WaitFromStepGroup`], a `step.completed` that counts its group).
pub fn finish_step(
    state: &RunState,
    c: &crate::fold::Completing,
    now: Timestamp,
    contract: &Contract,
) -> Vec<Draft> {
    let mut as_written = state.clone();
    as_written.cancel_requested = None;
    let mut take = state.gates.minus(c.gates);
    as_written.gates = c.gates;
    let gate = Gate::WaitFromStepGroup;
    if c.follows.is_some() {
        take = take.with(gate);
    } else {
        take = take.without(gate);
        as_written.gates = as_written.gates.without(gate);
    }
    complete_step_gated(
        &as_written,
        c.step,
        c.attempt,
        c.request_id.clone(),
        c.response.clone(),
        c.reused,
        now,
        contract,
        take,
    )
    .into_iter()
    .skip(1 + c.landed)
    .collect()
}

/// The backoff of model-call retries: 400 ms after the first failed attempt, doubling, at most
/// 51.2 s before the configuration's `max_retry_delay` caps it; half of each wait drawn at
/// random (equal jitter), so the runs a provider outage failed together do not all call again
/// at the same instant when it ends.
pub const MODEL_BACKOFF: crate::tools::Backoff = crate::tools::Backoff {
    initial: std::time::Duration::from_millis(400),
    max: std::time::Duration::from_millis(51_200),
    multiplier: 2.0,
    jitter: 0.5,
};

/// The wait before the next attempt of a model call after attempt `attempt` (1 for the first)
/// failed with a retryable error: the provider's `retry_after` when it sent one (it says when
/// the call will be taken; waiting less only earns another refusal), else [`MODEL_BACKOFF`]
/// with the jitter drawn from `draw` (a uniformly random `u64`: the step service draws it, the
/// core has no randomness); never more than `max` (`max_retry_delay`).
pub fn model_retry_delay(
    attempt: u32,
    retry_after: Option<std::time::Duration>,
    max: std::time::Duration,
    draw: u64,
) -> std::time::Duration {
    retry_after
        .unwrap_or_else(|| MODEL_BACKOFF.delay(attempt, draw))
        .min(max)
}

/// Provider trouble met by an attempt, for [`wait_on_provider`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TroubleMet {
    /// What the attempt's `model.attempt` records (an error with `trouble`, or `held`).
    pub outcome: crate::event::AttemptOutcome,
    pub trouble: crate::event::Trouble,
    /// The endpoint as operators know it (provider, base URL, key variable).
    pub endpoint: String,
    pub message: String,
}

/// The decisions that end attempt `attempt` of the open step when it met provider trouble or
/// the fleet's breaker held it: its `model.attempt` (spending nothing), the bound on the
/// step's wait the first time the step waits (a durable timer at `since + provider_wait`),
/// and `provider.waiting`. A step that waits again keeps its first wait's `since`, so the
/// bound holds for the step however often it is released and meets the trouble again. With a
/// cancel requested, only the attempt: the next decision cancels.
pub fn wait_on_provider(
    state: &RunState,
    request_id: &ModelRequestId,
    met: TroubleMet,
    now: Timestamp,
    provider_wait: std::time::Duration,
) -> Vec<Draft> {
    let (step, attempt) = (request_id.step(), request_id.attempt());
    let mut drafts = vec![
        Draft::new(Event::ModelAttempt(crate::event::ModelAttempt {
            request_id: request_id.clone(),
            outcome: met.outcome,
        }))
        .step(step)
        .attempt(attempt),
    ];
    if state.cancel_requested.is_some() {
        return drafts;
    }
    let since = state
        .provider
        .as_ref()
        .filter(|w| w.step == step)
        .map_or(now, |w| w.since);
    let mut give_up_at = since.saturating_add(provider_wait);
    if let Some(secs) = state.bundle.budget.deadline_secs {
        let deadline = state
            .created_at
            .saturating_add(std::time::Duration::from_secs(secs));
        give_up_at = give_up_at.min(deadline);
    }
    let timer_id = TimerId::for_provider_wait(&state.run_id, step);
    if !state.timers.contains_key(&timer_id) {
        drafts.push(Draft::new(Event::TimerScheduled(TimerScheduled {
            timer_id,
            fire_at: give_up_at,
            purpose: TimerPurpose::ProviderWait { step },
        })));
    }
    drafts.push(
        Draft::new(Event::ProviderWaiting(crate::event::ProviderWaiting {
            endpoint: met.endpoint,
            trouble: met.trouble,
            message: met.message,
            since,
            give_up_at,
        }))
        .step(step)
        .attempt(attempt),
    );
    drafts
}

/// What an approval request carries from the policy that held its operation back.
struct Held {
    risk: crate::event::Risk,
    basis: String,
    timeout_secs: Option<u64>,
    network: bool,
    retry: Option<crate::tools::RetryPolicy>,
    max_output_bytes: Option<u64>,
    reversibility: Option<crate::event::Reversibility>,
}

/// `approval.requested` (version `version`) and its expiry timer.
fn approval_request(
    op: &OperationId,
    call: &crate::event::ToolCall,
    args_digest: Digest,
    held: Held,
    version: u32,
    expires_at: Timestamp,
) -> [Draft; 2] {
    let approval_id = ApprovalId::for_operation(op, version);
    [
        Draft::new(Event::ApprovalRequested(ApprovalRequested {
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
            timeout_secs: held.timeout_secs,
            network: held.network,
            max_output_bytes: held.max_output_bytes,
            retry: held.retry,
            reversibility: held.reversibility,
        }))
        .step(op.step())
        .op(op.clone()),
        Draft::new(Event::TimerScheduled(TimerScheduled {
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
fn ask_again(
    a: &crate::fold::ApprovalState,
    tool: &crate::fold::ToolOp,
    from: Timestamp,
) -> [Draft; 2] {
    let ttl = a.request.expires_at.0 - a.requested_at.0;
    approval_request(
        &tool.op,
        &tool.call,
        tool.args_digest.clone(),
        Held {
            risk: a.request.risk,
            basis: a.request.basis.clone(),
            timeout_secs: a.request.timeout_secs,
            network: a.request.network,
            max_output_bytes: a.request.max_output_bytes,
            retry: a.request.retry.clone(),
            reversibility: a.request.reversibility.clone(),
        },
        a.request.plan_version.saturating_add(1),
        from.saturating_add_signed(ttl),
    )
}

/// What the approvals of the run call for: dispatch what was validly approved, expire what ran
/// out of time, invalidate (and ask again) what was approved for other arguments than these.
/// Empty when there is nothing to do.
fn act_on_approvals(state: &RunState) -> Vec<Draft> {
    let mut drafts = Vec::new();
    for (id, a) in &state.approvals {
        let Some(op) = &a.op else { continue };
        let Some(tool) = state.ops.get(op) else {
            continue;
        };
        if tool.result.is_some() || tool.status != OpStatus::AwaitingApproval {
            continue;
        }
        let expire = || {
            Draft::new(Event::ApprovalExpired(ApprovalExpired {
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
                        Draft::new(Event::ApprovalInvalidated(ApprovalInvalidated {
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
                        Draft::new(Event::ApprovalInvalidated(ApprovalInvalidated {
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
                        Draft::new(Event::ToolRequested(ToolRequested {
                            call_id: tool.call.call_id.clone(),
                            tool: tool.call.name.clone(),
                            arguments: tool.call.arguments.clone(),
                            args_digest: tool.args_digest.clone(),
                            // 0 the first time; after its target moved, the next dispatch.
                            redispatch: tool.dispatches,
                            expect_version: a.request.target_version.clone(),
                            timeout_secs: tool.timeout_secs,
                            network: tool.network,
                            max_output_bytes: tool.max_output_bytes,
                            retry: tool.retry.clone(),
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
    // An invalidation whose fresh request was cut short (the writer died between the appends)
    // leaves an operation held with no request open: ask again.
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
    drafts
}

/// The target version of the approval an operation runs under, if any.
fn approved_version(state: &RunState, op: &OperationId) -> Option<String> {
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

/// The run-deadline timer fired.
fn deadline_passed(state: &RunState) -> bool {
    state
        .timers
        .values()
        .any(|t| t.fired && t.purpose == TimerPurpose::RunDeadline)
}

fn has_ambiguous(state: &RunState) -> bool {
    state
        .ops
        .values()
        .any(|o| matches!(o.status, OpStatus::Ambiguous { .. }))
}

fn unknown(state: &RunState) -> Next {
    Next::Commit(vec![Draft::new(Event::RunUnknown(RunUnknown {
        reason: ambiguous_reason(state),
    }))])
}

fn ambiguous_reason(state: &RunState) -> String {
    let ops: Vec<String> = state
        .ops
        .values()
        .filter_map(|o| match &o.status {
            OpStatus::Ambiguous { detail } => Some(format!("{}: {detail}", o.op)),
            _ => None,
        })
        .collect();
    format!(
        "the outcome of {} is unknown; a person must resolve it",
        ops.join("; ")
    )
}

/// `tool.requested` again, same operation and arguments, for every operation found not to have
/// happened.
fn redispatches(state: &RunState) -> Vec<Draft> {
    state
        .ops
        .values()
        .filter(|o| o.status == OpStatus::ToRetry)
        .map(|o| {
            Draft::new(Event::ToolRequested(ToolRequested {
                call_id: o.call.call_id.clone(),
                tool: o.call.name.clone(),
                arguments: o.call.arguments.clone(),
                args_digest: o.args_digest.clone(),
                redispatch: o.dispatches,
                expect_version: approved_version(state, &o.op),
                timeout_secs: o.timeout_secs,
                network: o.network,
                max_output_bytes: o.max_output_bytes,
                retry: o.retry.clone(),
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
fn running_ops(state: &RunState) -> usize {
    state
        .ops
        .values()
        .filter(|o| {
            matches!(o.status, OpStatus::Started { .. })
                || (o.result.is_none() && state.children.contains_key(&o.op))
        })
        .count()
}

fn cancelled(state: &RunState) -> Draft {
    Draft::new(Event::RunCancelled(RunCancelled {
        operations: state.op_summaries(),
    }))
}

fn finish_cancel(state: &RunState) -> Next {
    let running = running_ops(state);
    if running > 0 {
        return Next::Idle(Idle::Stopping { running });
    }
    Next::Commit(vec![cancelled(state)])
}

fn fail(reason: FailureReason, message: String) -> Next {
    Next::Commit(vec![Draft::new(Event::RunFailed(RunFailed {
        reason,
        message,
        effects: Vec::new(),
    }))])
}

fn new_step(state: &RunState, budget: &Budget, mut prefix: Vec<Draft>) -> Next {
    // An exhausted budget fails the run after the prefix (`run.started`, `run.revived`): a
    // message to a finished run whose budget is spent revives it and then fails it with the
    // reason, a sequence the state machine allows (a bare `run.failed` from `succeeded` is not).
    let fail_after = |prefix: Vec<Draft>, reason, message: String| {
        let mut drafts = prefix;
        drafts.push(Draft::new(Event::RunFailed(RunFailed {
            reason,
            message,
            effects: Vec::new(),
        })));
        Next::Commit(drafts)
    };
    if state.step.get() >= budget.max_steps {
        return fail_after(
            prefix,
            FailureReason::MaxSteps,
            format!("the run used its {} steps", budget.max_steps),
        );
    }
    if state.usage.total() >= budget.max_tokens {
        return fail_after(
            prefix,
            FailureReason::MaxTokens,
            format!(
                "the run used {} of its {} tokens",
                state.usage.total(),
                budget.max_tokens
            ),
        );
    }
    // Cost is counted like tokens: each `step.completed` carries what its usage cost at the
    // frozen `model.price`, and no new step starts once the sum reached the limit.
    if let Some(max_cost) = budget.max_cost {
        let spent = state.usage.cost.unwrap_or(0.0);
        if spent >= max_cost {
            let currency = state.bundle.model.currency().unwrap_or_default();
            return fail_after(
                prefix,
                FailureReason::MaxCost,
                format!("the run cost {spent} of its {max_cost} {currency}"),
            );
        }
    }
    if let Some(secs) = budget.deadline_secs
        && !state
            .timers
            .values()
            .any(|t| t.purpose == TimerPurpose::RunDeadline)
    {
        // The deadline counts from creation (for the whole run, revivals included); the timer
        // is durable like any other. Scheduled with the first step, or the next one if the
        // group that should have scheduled it was cut short.
        prefix.push(Draft::new(Event::TimerScheduled(TimerScheduled {
            timer_id: TimerId::for_deadline(&state.run_id),
            fire_at: state
                .created_at
                .saturating_add(std::time::Duration::from_secs(secs)),
            purpose: TimerPurpose::RunDeadline,
        })));
    }
    let step = state.step.next();
    let p = plan(state, step, Attempt(1), None, std::mem::take(&mut prefix));
    Next::Step(Box::new(p))
}

fn plan(
    state: &RunState,
    step: StepNo,
    attempt: Attempt,
    unfinished: Option<(ModelRequestId, Digest)>,
    mut start: Vec<Draft>,
) -> StepPlan {
    let request_id = ModelRequestId::new(&state.run_id, step, attempt);
    let (context, context_digest) = state.next_context_digested();
    start.push(
        Draft::new(Event::StepStarted(StepStarted {
            request_id: request_id.clone(),
            context_digest: context_digest.clone(),
            inputs_through: state.last_seq,
            model: None,
        }))
        .step(step)
        .attempt(attempt),
    );
    StepPlan {
        step,
        attempt,
        request_id,
        unfinished,
        context,
        context_digest,
        start,
        released: None,
    }
}

/// The decisions that complete a step with the model's response, as the live writer makes them
/// (taking every gate this build knows: [`complete_step_gated`] with [`Gates::all`]).
// Each argument is a distinct recorded fact of the commit (which attempt, what the model said,
// whether it was reused, the clock reading, the frozen policy); bundling them would only rename them.
#[allow(clippy::too_many_arguments)]
pub fn complete_step(
    state: &RunState,
    step: StepNo,
    attempt: Attempt,
    request_id: ModelRequestId,
    response: ModelResponse,
    reused: bool,
    now: Timestamp,
    contract: &Contract,
) -> Vec<Draft> {
    complete_step_gated(
        state,
        step,
        attempt,
        request_id,
        response,
        reused,
        now,
        contract,
        Gates::all(),
    )
}

/// The decisions that complete a step with the model's response: `step.completed`, one
/// `tool.requested` per tool call (operation id `(run, step, index)`), `question.asked` for
/// `ask_user` calls, `timer.scheduled` for `wait` calls (due `now` + the seconds asked), and then
/// what the run waits on, or for a final answer what [`final_answer`] makes of it
/// (`run.succeeded`, `output.rejected`, `run.failed`). One group. `now` is the commit's clock
/// reading; it is recorded (as the timer's `fire_at`), so replay does not depend on it.
///
/// Version gates: `take` names the gates this group may take for the first time (the live
/// writer: all it knows; replay: those whose marker the recorded group carries); a gate the run
/// marked already is taken anyway. [`Gate::WaitFromStepGroup`]: a step that requested tools
/// ends its group with `run.waiting {on}` on the old branch; on the new one, when it waits on
/// its tools alone (`on` = `tool`), its `step.completed` counts the decisions that follow it
/// (`follows`, the marker included the first time) and the fold derives the same status from
/// them.
#[allow(clippy::too_many_arguments)]
pub fn complete_step_gated(
    state: &RunState,
    step: StepNo,
    attempt: Attempt,
    request_id: ModelRequestId,
    response: ModelResponse,
    reused: bool,
    now: Timestamp,
    contract: &Contract,
    take: Gates,
) -> Vec<Draft> {
    // What the step cost, at the frozen price of the model that answered (the run's, or the
    // fallback its attempt's `step.started` names), recomputed from the tokens, so a step
    // finished by another worker records the same.
    let fallback = state.open_step.as_ref().and_then(|o| o.model.as_ref());
    let price = fallback.unwrap_or(&state.bundle.model).price.as_ref();
    let response = ModelResponse {
        usage: response.usage.priced(price),
        ..response
    };
    let model = fallback.map(|m| m.name.clone());
    if let Some(reason) = &state.cancel_requested {
        // The answer is recorded (it was paid for) but nothing it asks for is dispatched.
        let mut drafts = vec![
            Draft::new(Event::StepCompleted(StepCompleted {
                request_id,
                message: response.message,
                usage: response.usage,
                finish: response.finish,
                reused,
                follows: None,
                model: model.clone(),
            }))
            .step(step)
            .attempt(attempt),
            Draft::new(Event::RunCancelling(RunCancelling {
                reason: reason.clone(),
            })),
        ];
        if running_ops(state) == 0 {
            drafts.push(cancelled(state));
        }
        return crate::compensation::intercept(state, drafts);
    }
    let mut drafts = Vec::with_capacity(response.message.tool_calls.len() * 2 + 2);
    let mut refused_any = false;
    let mut tool_drafts = Vec::new();
    for (index, call) in response.message.tool_calls.iter().enumerate() {
        // The tool contract: a call to a tool the revision does not declare, or with arguments
        // its schema refuses, is not dispatched (nor held for approval, nor handled by the step).
        // Its error result is the refusal ([`StepPlan::answer_refused`]).
        if contract.check(call).is_err() {
            refused_any = true;
            continue;
        }
        let op = OperationId::new(&state.run_id, step, index as u32);
        let tool_policy = contract.policy(&call.name);
        if let Some(basis) = tool_policy.approval_basis(&call.name)
            && !crate::fold::handled_by_step(&call.name)
        {
            // Held back: nothing runs until a person approves exactly these arguments.
            let ttl = std::time::Duration::from_secs(
                tool_policy
                    .approval_ttl_secs
                    .unwrap_or(DEFAULT_APPROVAL_TTL_SECS),
            );
            tool_drafts.extend(approval_request(
                &op,
                call,
                Digest::of_json(&call.arguments),
                Held {
                    risk: tool_policy.risk,
                    basis,
                    timeout_secs: tool_policy.timeout_secs,
                    network: tool_policy.network,
                    max_output_bytes: tool_policy.max_output_bytes,
                    retry: tool_policy.retry.clone(),
                    reversibility: contract.reversibility(&call.name),
                },
                1,
                now.saturating_add(ttl),
            ));
            continue;
        }
        tool_drafts.push(
            Draft::new(Event::ToolRequested(ToolRequested {
                call_id: call.call_id.clone(),
                tool: call.name.clone(),
                arguments: call.arguments.clone(),
                args_digest: Digest::of_json(&call.arguments),
                redispatch: 0,
                expect_version: None,
                timeout_secs: tool_policy.timeout_secs,
                network: tool_policy.network,
                max_output_bytes: tool_policy.max_output_bytes,
                retry: tool_policy.retry.clone(),
                reversibility: contract.reversibility(&call.name),
                compensates: None,
            }))
            .step(step)
            .op(op.clone()),
        );
        if call.name == ASK_USER_TOOL {
            let prompt = call
                .arguments
                .get("question")
                .and_then(|q| q.as_str())
                .map(str::to_owned)
                .unwrap_or_else(|| call.arguments.to_string());
            let question_id = QuestionId::for_operation(&op);
            tool_drafts.push(
                Draft::new(Event::QuestionAsked(QuestionAsked {
                    question_id: question_id.clone(),
                    prompt,
                }))
                .step(step)
                .op(op.clone()),
            );
            // `timeout_seconds`: the question closes unanswered then (a durable timer).
            if call.arguments.get("timeout_seconds").is_some() {
                tool_drafts.push(
                    Draft::new(Event::TimerScheduled(TimerScheduled {
                        timer_id: TimerId::for_operation(&op),
                        fire_at: now.saturating_add(seconds_arg(
                            &call.arguments,
                            "timeout_seconds",
                            0,
                        )),
                        purpose: TimerPurpose::QuestionTimeout { question_id },
                    }))
                    .step(step)
                    .op(op),
                );
            }
        } else if call.name == crate::child::RUN_AGENT_TOOL {
            // A child the run may start is linked now; a refused one never starts, and the
            // step service gives the operation its refusal as the result.
            if let crate::child::Plan::Start { child, agent, .. } =
                crate::child::plan(state, &op, call)
            {
                tool_drafts.push(
                    Draft::new(Event::ChildStarted(ChildStarted { child, agent }))
                        .step(step)
                        .op(op),
                );
            }
        } else if call.name == WAIT_TOOL {
            let fire_at = now.saturating_add(seconds_arg(&call.arguments, "seconds", 0));
            tool_drafts.push(
                Draft::new(Event::TimerScheduled(TimerScheduled {
                    timer_id: TimerId::for_operation(&op),
                    fire_at,
                    purpose: TimerPurpose::Wait { op: op.clone() },
                }))
                .step(step)
                .op(op),
            );
        } else if call.name == AWAIT_CALLBACK_TOOL {
            let key = CallbackKey::for_operation(&op);
            let expires_at = now.saturating_add(seconds_arg(
                &call.arguments,
                "timeout_seconds",
                DEFAULT_CALLBACK_SECS,
            ));
            tool_drafts.push(
                Draft::new(Event::CallbackExpected(CallbackExpected {
                    key: key.clone(),
                    expires_at: Some(expires_at),
                }))
                .step(step)
                .op(op.clone()),
            );
            tool_drafts.push(
                Draft::new(Event::TimerScheduled(TimerScheduled {
                    timer_id: TimerId::for_operation(&op),
                    fire_at: expires_at,
                    purpose: TimerPurpose::CallbackExpiry { key },
                }))
                .step(step)
                .op(op),
            );
        }
    }
    // Refused calls still wait for their results: the run goes on with the next step, whose
    // context answers them.
    let has_tools = !tool_drafts.is_empty() || refused_any;
    let output = response.message.text.clone();
    let on = crate::fold::group_waits_on(tool_drafts.iter().map(|d| &d.event));
    // Gate `wait_from_step_group`: a group that waits on its tools alone settles the status by
    // itself (no `run.waiting`). One that waits on a person, a timer or a callback keeps its
    // `run.waiting`: the last event of such a run tells the reconciler it is settled without a
    // read of its journal, and it is not on the hot path.
    let gate = Gate::WaitFromStepGroup;
    let settles_itself =
        has_tools && on == WaitReason::Tool && (state.gates.contains(gate) || take.contains(gate));
    let marker = (settles_itself && !state.gates.contains(gate))
        .then(|| Draft::new(Event::RunGated(RunGated { gate })).step(step));
    let follows = settles_itself.then(|| {
        u32::try_from(tool_drafts.len() + usize::from(marker.is_some())).unwrap_or(u32::MAX)
    });
    drafts.push(
        Draft::new(Event::StepCompleted(StepCompleted {
            request_id,
            message: response.message,
            usage: response.usage,
            finish: response.finish,
            reused,
            follows,
            model,
        }))
        .step(step)
        .attempt(attempt),
    );
    drafts.extend(marker);
    drafts.extend(tool_drafts);
    if !has_tools {
        drafts.push(Draft::new(final_answer(state, contract, output)).step(step));
    } else if follows.is_none() {
        drafts.push(Draft::new(Event::RunWaiting(RunWaiting { on })).step(step));
    }
    crate::compensation::intercept(state, drafts)
}

/// What the final answer `output` (a step that calls no tools) means for the run, by its check
/// against the output schema of the run's revision and the agent's `on_invalid_output`:
/// `run.succeeded` (valid, not checked, or invalid under `accept`), `output.rejected` (invalid
/// under `retry` with retries left in this turn: the run goes on), or `run.failed` with reason
/// `invalid_output` (invalid under `fail`, or under `retry` once the retries are used up).
pub fn final_answer(state: &RunState, contract: &Contract, output: String) -> Event {
    let errors = match contract.check_output(&output) {
        OutputValidation::Invalid { errors } => errors,
        validation @ (OutputValidation::Valid | OutputValidation::NotChecked) => {
            return Event::RunSucceeded(RunSucceeded { output, validation });
        }
    };
    let failed = |message: String| {
        Event::RunFailed(RunFailed {
            reason: FailureReason::InvalidOutput,
            message,
            effects: Vec::new(),
        })
    };
    match contract.on_invalid_output() {
        OnInvalidOutput::Accept => Event::RunSucceeded(RunSucceeded {
            output,
            validation: OutputValidation::Invalid { errors },
        }),
        OnInvalidOutput::Fail => failed(format!(
            "the answer does not match output_schema: {}",
            errors.join("; ")
        )),
        OnInvalidOutput::Retry => {
            let max = contract.output_retries();
            let used = state.output_rejections;
            if used < max {
                Event::OutputRejected(OutputRejected {
                    errors,
                    retry: used.saturating_add(1),
                    max_retries: max,
                })
            } else {
                failed(format!(
                    "the answer does not match output_schema after {used} {}: {}",
                    if used == 1 { "retry" } else { "retries" },
                    errors.join("; ")
                ))
            }
        }
    }
}
