//! Completing a step: the decisions that record the model's answer and act on it (the tool
//! calls it makes, or its final answer), and the rest of a group a writer left cut short.

use crate::agent::{DEFAULT_APPROVAL_TTL_SECS, OnInvalidOutput};
use crate::event::{
    CallbackExpected, ChildStarted, Decision, Digest, Draft, FailureReason, Gate, OutputRejected,
    OutputValidation, QuestionAsked, RunCancelling, RunFailed, RunGated, RunSucceeded, RunWaiting,
    StepCompleted, TimerPurpose, TimerScheduled, Timestamp, ToolCall, ToolRequested, WaitReason,
};
use crate::fold::{ASK_USER_TOOL, AWAIT_CALLBACK_TOOL, Gates, RunState, WAIT_TOOL};
use crate::ids::{Attempt, CallbackKey, ModelRequestId, OperationId, QuestionId, StepNo, TimerId};
use crate::tools::Contract;

use super::ModelResponse;
use super::approvals::{Held, approval_request};
use super::operations::running_ops;
use super::status::cancelled;

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
) -> Vec<Draft<Decision>> {
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
) -> Vec<Draft<Decision>> {
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
) -> Vec<Draft<Decision>> {
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
        let completed = Draft::new(Decision::StepCompleted(StepCompleted {
            request_id,
            message: response.message,
            usage: response.usage,
            finish: response.finish,
            reused,
            follows: None,
            model: model.clone(),
        }))
        .step(step)
        .attempt(attempt);
        return cancel_after_answer(state, completed, reason);
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
        tool_drafts.extend(call_drafts(state, step, op, call, now, contract));
    }
    // Refused calls still wait for their results: the run goes on with the next step, whose
    // context answers them.
    let has_tools = !tool_drafts.is_empty() || refused_any;
    let output = response.message.text.clone();
    let on = crate::fold::group_waits_on(tool_drafts.iter().map(|d| d.event.borrowed()));
    // Gate `wait_from_step_group`: a group that waits on its tools alone settles the status by
    // itself (no `run.waiting`). One that waits on a person, a timer or a callback keeps its
    // `run.waiting`: the last event of such a run tells the reconciler it is settled without a
    // read of its journal, and it is not on the hot path.
    let gate = Gate::WaitFromStepGroup;
    let settles_itself =
        has_tools && on == WaitReason::Tool && (state.gates.contains(gate) || take.contains(gate));
    let marker = (settles_itself && !state.gates.contains(gate))
        .then(|| Draft::new(Decision::RunGated(RunGated { gate })).step(step));
    let follows = settles_itself.then(|| {
        u32::try_from(tool_drafts.len() + usize::from(marker.is_some())).unwrap_or(u32::MAX)
    });
    drafts.push(
        Draft::new(Decision::StepCompleted(StepCompleted {
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
        drafts.push(Draft::new(Decision::RunWaiting(RunWaiting { on })).step(step));
    }
    crate::compensation::intercept(state, drafts)
}

/// A step answered while a cancel was requested: its `step.completed`, then `run.cancelling`,
/// and `run.cancelled` when no operation is running.
fn cancel_after_answer(
    state: &RunState,
    completed: Draft<Decision>,
    reason: &str,
) -> Vec<Draft<Decision>> {
    let mut drafts = vec![
        completed,
        Draft::new(Decision::RunCancelling(RunCancelling {
            reason: reason.to_owned(),
        })),
    ];
    if running_ops(state) == 0 {
        drafts.push(cancelled(state));
    }
    crate::compensation::intercept(state, drafts)
}

/// The decisions of one tool call the contract allows, as operation `op`: held back for a
/// person's approval when the policy says so, else dispatched (`tool.requested`) with what the
/// step does itself for the tools it handles ([`handled_tool_drafts`]).
fn call_drafts(
    state: &RunState,
    step: StepNo,
    op: OperationId,
    call: &ToolCall,
    now: Timestamp,
    contract: &Contract,
) -> Vec<Draft<Decision>> {
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
        return approval_request(
            &op,
            call,
            Digest::of_json(&call.arguments),
            Held {
                risk: tool_policy.risk,
                basis,
                limits: tool_policy.limits(),
                reversibility: contract.reversibility(&call.name),
            },
            1,
            now.saturating_add(ttl),
        )
        .into();
    }
    let mut drafts = vec![
        Draft::new(Decision::ToolRequested(ToolRequested {
            call_id: call.call_id.clone(),
            tool: call.name.clone(),
            arguments: call.arguments.clone(),
            args_digest: Digest::of_json(&call.arguments),
            redispatch: 0,
            expect_version: None,
            limits: tool_policy.limits(),
            reversibility: contract.reversibility(&call.name),
            compensates: None,
        }))
        .step(step)
        .op(op.clone()),
    ];
    drafts.extend(handled_tool_drafts(state, step, op, call, now));
    drafts
}

/// What the step does itself for a tool it handles, after its `tool.requested`: `ask_user`
/// asks (`question.asked`, and a timeout timer), `run_agent` links the child it may start
/// (`child.started`), `wait` schedules its timer, `await_callback` expects its callback (and an
/// expiry timer). Nothing for other tools.
fn handled_tool_drafts(
    state: &RunState,
    step: StepNo,
    op: OperationId,
    call: &ToolCall,
    now: Timestamp,
) -> Vec<Draft<Decision>> {
    let mut tool_drafts = Vec::new();
    if call.name == ASK_USER_TOOL {
        let prompt = call
            .arguments
            .get("question")
            .and_then(|q| q.as_str())
            .map(str::to_owned)
            .unwrap_or_else(|| call.arguments.to_string());
        let question_id = QuestionId::for_operation(&op);
        tool_drafts.push(
            Draft::new(Decision::QuestionAsked(QuestionAsked {
                question_id: question_id.clone(),
                prompt,
            }))
            .step(step)
            .op(op.clone()),
        );
        // `timeout_seconds`: the question closes unanswered then (a durable timer).
        if call.arguments.get("timeout_seconds").is_some() {
            tool_drafts.push(
                Draft::new(Decision::TimerScheduled(TimerScheduled {
                    timer_id: TimerId::for_operation(&op),
                    fire_at: now.saturating_add(seconds_arg(&call.arguments, "timeout_seconds", 0)),
                    purpose: TimerPurpose::QuestionTimeout { question_id },
                }))
                .step(step)
                .op(op),
            );
        }
    } else if call.name == crate::child::RUN_AGENT_TOOL {
        // A child the run may start is linked now; a refused one never starts, and the
        // step service gives the operation its refusal as the result.
        if let crate::child::Plan::Start { child, agent, .. } = crate::child::plan(state, &op, call)
        {
            tool_drafts.push(
                Draft::new(Decision::ChildStarted(ChildStarted { child, agent }))
                    .step(step)
                    .op(op),
            );
        }
    } else if call.name == WAIT_TOOL {
        let fire_at = now.saturating_add(seconds_arg(&call.arguments, "seconds", 0));
        tool_drafts.push(
            Draft::new(Decision::TimerScheduled(TimerScheduled {
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
            Draft::new(Decision::CallbackExpected(CallbackExpected {
                key: key.clone(),
                expires_at: Some(expires_at),
            }))
            .step(step)
            .op(op.clone()),
        );
        tool_drafts.push(
            Draft::new(Decision::TimerScheduled(TimerScheduled {
                timer_id: TimerId::for_operation(&op),
                fire_at: expires_at,
                purpose: TimerPurpose::CallbackExpiry { key },
            }))
            .step(step)
            .op(op),
        );
    }
    tool_drafts
}

/// What the final answer `output` (a step that calls no tools) means for the run, by its check
/// against the output schema of the run's revision and the agent's `on_invalid_output`:
/// `run.succeeded` (valid, not checked, or invalid under `accept`), `output.rejected` (invalid
/// under `retry` with retries left in this turn: the run goes on), or `run.failed` with reason
/// `invalid_output` (invalid under `fail`, or under `retry` once the retries are used up).
pub fn final_answer(state: &RunState, contract: &Contract, output: String) -> Decision {
    let errors = match contract.check_output(&output) {
        OutputValidation::Invalid { errors } => errors,
        validation @ (OutputValidation::Valid | OutputValidation::NotChecked) => {
            return Decision::RunSucceeded(RunSucceeded { output, validation });
        }
    };
    let failed = |message: String| {
        Decision::RunFailed(RunFailed {
            reason: FailureReason::InvalidOutput,
            message,
            effects: Vec::new(),
        })
    };
    match contract.on_invalid_output() {
        OnInvalidOutput::Accept => Decision::RunSucceeded(RunSucceeded {
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
                Decision::OutputRejected(OutputRejected {
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
