//! Model calls and their provider: the backoff of retries, and the wait on a provider in
//! trouble (docs/ARCHITECTURE.md "Provider trouble").

use crate::event::{Decision, Draft, TimerPurpose, TimerScheduled, Timestamp};
use crate::fold::RunState;
use crate::ids::{ModelRequestId, TimerId};

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
) -> Vec<Draft<Decision>> {
    let (step, attempt) = (request_id.step(), request_id.attempt());
    let mut drafts = vec![
        Draft::new(Decision::ModelAttempt(crate::event::ModelAttempt {
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
        drafts.push(Draft::new(Decision::TimerScheduled(TimerScheduled {
            timer_id,
            fire_at: give_up_at,
            purpose: TimerPurpose::ProviderWait { step },
        })));
    }
    drafts.push(
        Draft::new(Decision::ProviderWaiting(crate::event::ProviderWaiting {
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
