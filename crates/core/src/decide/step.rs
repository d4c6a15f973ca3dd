//! Starting a step: the budget's checks, the deadline timer, and the plan of the model call.

use crate::event::{
    Budget, Decision, Digest, Draft, FailureReason, RunFailed, StepStarted, TimerPurpose,
    TimerScheduled,
};
use crate::fold::RunState;
use crate::ids::{Attempt, ModelRequestId, StepNo, TimerId};

use super::{Next, StepPlan};

pub(super) fn new_step(
    state: &RunState,
    budget: &Budget,
    mut prefix: Vec<Draft<Decision>>,
) -> Next {
    // An exhausted budget fails the run after the prefix (`run.started`, `run.revived`): a
    // message to a finished run whose budget is spent revives it and then fails it with the
    // reason, a sequence the state machine allows (a bare `run.failed` from `succeeded` is not).
    let fail_after = |prefix: Vec<Draft<Decision>>, reason, message: String| {
        let mut drafts = prefix;
        drafts.push(Draft::new(Decision::RunFailed(RunFailed {
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
        prefix.push(Draft::new(Decision::TimerScheduled(TimerScheduled {
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

pub(super) fn plan(
    state: &RunState,
    step: StepNo,
    attempt: Attempt,
    unfinished: Option<(ModelRequestId, Digest)>,
    mut start: Vec<Draft<Decision>>,
) -> StepPlan {
    let request_id = ModelRequestId::new(&state.run_id, step, attempt);
    let (context, context_digest) = state.next_context_digested();
    start.push(
        Draft::new(Decision::StepStarted(StepStarted {
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
